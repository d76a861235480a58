"""The CPU profile: everything that exists only for XLA:CPU, in one place. Nothing here changes
what runs on a GPU or TPU."""
