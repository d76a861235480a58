"""The CPU backend (``backend.CpuBackend``) and everything that exists only for XLA:CPU: bfloat16
products (``matmul``) and attention (``attention``) on bf16 units, the decoding layout
(``decode``), oneDNN products (``onednn``), mimalloc (``allocator``), microbatches
(``microbatches``), CPU polling (``poll``), and which CPUs each rule was measured on
(``measured``). Nothing here changes what runs on a GPU or TPU."""
