"""pyproject.toml installs every package folder, under the tvmamp import root only."""

import os

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_package_folder_is_listed():
    config = _config()
    listed = set(config["packages"])
    for package, folder in config["package-dir"].items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
                name = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
                assert name in listed, f"{name} ({dirpath}) is missing from pyproject packages"


def test_component_folders_install_under_tvmamp():
    config = _config()
    assert config["package-dir"] == {
        "tvmamp": "tvmamp",
        "tvmamp.relay_passes": "relay_passes",
        "tvmamp.schedules": "schedules",
        "tvmamp.targets": "targets",
    }
    assert all(name == "tvmamp" or name.startswith("tvmamp.") for name in config["packages"])
