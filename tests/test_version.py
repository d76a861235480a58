"""The version is written once (``transformer_jax.__version__``); the build and the installed
metadata read that one."""

import importlib.metadata
import json
import pathlib
import re
import tomllib
import urllib.parse

import pytest

import transformer_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_is_a_release_number():
  assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", transformer_jax.__version__)


def test_pyproject_writes_no_version_of_its_own():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert "version" not in project and "version" in project["dynamic"]


def test_the_build_reads_the_package_version():
  from setuptools.config.pyprojecttoml import read_configuration

  config = read_configuration(ROOT / "pyproject.toml", expand=True)
  assert config["project"]["version"] == transformer_jax.__version__


def test_the_installed_metadata_agrees_when_installed_from_this_tree():
  try:
    dist = importlib.metadata.distribution("transformer-jax")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("transformer-jax is not installed (a source tree on PYTHONPATH)")
  url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
  source = pathlib.Path(urllib.parse.urlparse(url).path) if url.startswith("file:") else None
  if source is None or source.resolve() != ROOT:
    pytest.skip(f"transformer-jax is installed from {url or 'an index'}, not from {ROOT}")
  assert dist.version == transformer_jax.__version__, "reinstall: pip install -e ."
