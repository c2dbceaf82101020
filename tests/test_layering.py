"""`models` and `decoding` stand on their own (DESIGN.md's direction of imports): they import nothing of the service,
and load and run a model on what the GPU image has, torch, numpy, sentencepiece and PyYAML. Reading files wants
soundfile, soxr or PyAV, which are imported only when a file is read; the training recipe reads its corpus with
soundfile, but it too stays clear of the service."""

import subprocess
import sys
import textwrap

SERVICE_SIDE = ("service", "fastapi", "starlette", "uvicorn", "redis", "httpx", "pydantic", "pydantic_settings",
                "prometheus_client", "multipart")
FILE_READERS = ("soundfile", "soxr", "av")

CHECK = textwrap.dedent("""
    import importlib, pkgutil, sys
    import numpy as np

    blocked = set(sys.argv[1].split(","))
    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ImportError(f"{name} is not for models and decoding")
    sys.meta_path.insert(0, Blocked())

    import decoding, models
    skip = sys.argv[2]  # a package left out of the walk ("" for none)
    for package in (decoding, models):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not (skip and info.name.startswith(skip)):
                importlib.import_module(info.name)
    # and the default model decodes an array with what is left
    noise = np.random.default_rng(0).standard_normal(16000 * 2).astype(np.float32) * 0.01
    models.load_model(device="cpu").transcribe([noise], batch_size=1)
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in blocked)
    assert not loaded, loaded
""")


def _imports_without(blocked: tuple[str, ...], skip: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK, ",".join(blocked), skip], capture_output=True, text=True,
                          check=False, timeout=300)


def test_models_and_decoding_import_and_run_without_the_service_or_file_readers():
    done = _imports_without(SERVICE_SIDE + FILE_READERS, skip="models.training")
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_training_recipe_imports_nothing_of_the_service():
    done = _imports_without(SERVICE_SIDE, skip="")
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_check_can_fail():
    """A package that does import a file reader is caught: models.training reads its corpus with soundfile."""
    done = _imports_without(FILE_READERS, skip="")
    assert done.returncode != 0 and "soundfile" in done.stderr
