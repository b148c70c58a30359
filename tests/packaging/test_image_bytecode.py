"""The product image's bytecode is valid as shipped: the operator (a non-root user on a read-only root)
cannot write a .pyc, so a stale one is compiled again at every start. With mtime-checked .pyc files, the
image layers' rounding of file times left a quarter of them stale, and the operator took six minutes
to start on a testbed node."""

from __future__ import annotations

import json
import struct
import tarfile

import pytest

from testbed import images

pytestmark = pytest.mark.images

VENV = "opt/ibckpt/venv/lib/python3.11/site-packages/"


def _venv_layer_name(archive: tarfile.TarFile) -> str:
    manifest = json.load(archive.extractfile("manifest.json"))  # type: ignore[arg-type]
    for layer in reversed(manifest[0]["Layers"]):
        with tarfile.open(fileobj=archive.extractfile(layer)) as inner:
            if any(name.startswith(VENV) for name in inner.getnames()):
                return str(layer)
    raise AssertionError(f"no layer of the product image holds {VENV}")


def test_every_module_of_the_venv_has_hash_checked_bytecode() -> None:
    image = images.build(only=["ibckpt"])["ibckpt"]
    with (
        tarfile.open(image.tar) as archive,
        tarfile.open(fileobj=archive.extractfile(_venv_layer_name(archive))) as layer,
    ):
        names = set(layer.getnames())
        sources = [n for n in names if n.startswith(VENV) and n.endswith(".py") and "/__pycache__/" not in n]
        by_time = []
        missing = []
        for source in sources:
            folder, _, file = source.rpartition("/")
            pyc = f"{folder}/__pycache__/{file[:-3]}.cpython-311.pyc"
            if pyc not in names:
                missing.append(source)
                continue
            header = layer.extractfile(pyc).read(8)  # type: ignore[union-attr]
            (flags,) = struct.unpack("<I", header[4:8])
            if not flags & 1:  # PEP 552: bit 0 set means hash-based
                by_time.append(pyc)
    assert len(sources) > 1000, f"only {len(sources)} modules in the image's venv"
    assert missing == [], f"{len(missing)} modules without bytecode, e.g. {missing[:3]}"
    assert by_time == [], f"{len(by_time)} mtime-checked .pyc files, e.g. {by_time[:3]}"
