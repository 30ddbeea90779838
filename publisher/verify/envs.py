"""Verification environments built from version specs: this environment with only the named packages replaced.

``--verify-env diffusers==0.38.0`` (and the compatibility matrix, publisher/compat.py) need an interpreter in
which the named packages have other versions and everything else is what this tool runs with. Building one:

- a venv without pip (a fraction of a second), whose own site-packages comes first on ``sys.path``, and a
  ``.pth`` file that appends this environment's site-packages after it (``site.addsitedir``, so their own
  ``.pth`` files work too): the layer sees every package installed here and shadows only what it holds;
- ``python -m pip install SPEC`` run *in* the layer: pip sees this environment's packages as installed, so it
  installs the named packages and only those dependencies this environment cannot satisfy (transformers 4.57
  brings huggingface_hub < 1.0, diffusers 0.38 brings nothing). torch is pinned to this environment's
  version unless the spec names it, so no multi-GB torch download happens by accident. ``--no-compile``: pip would
  compile every file it installs to bytecode (transformers' 3,000, half of a 9 s build), of which a load imports a
  few hundred, compiled and cached by the first import that needs them (measured: transformers==5.0.0 built in
  9.1 s of CPU, 4.4 s without; its first import of torch and the model base classes 4.1 s, 4.5 s without);
- the exact versions the layer holds are read back and recorded.

Entries are cached under ``$HF_AO_PUBLISH_ENVS`` (default ``$HF_HOME/hf-ao-publish/envs``), keyed by the spec
and by this environment (interpreter, site-packages folders, every installed version), and reused across
runs. An entry is built in a temporary folder and renamed into place with its record written last, so a
half-built one is never used.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import os
import re
import shutil
import site
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from publisher.errors import EnvBuildError, UsageError
from publisher.io import keptfile
from publisher.verify import torch_sources

log = logging.getLogger(__name__)

RECORD = "hf-ao-publish-env.json"
PTH = "zz-hf-ao-publish-layer.pth"  # processed after the layer's own .pth files (alphabetical order)
PIP_TIMEOUT_S = 1800
UNBUILDABLE = "unbuildable.json"  # unasked specs that could not be built here, remembered for a day
UNBUILDABLE_TTL_S = 24 * 3600
ZYGOTE_NOTES = "hf-ao-publish-zygote.json"  # in a built environment's folder: import lists its zygotes cannot make
_NAME = re.compile(r"^\s*[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class EnvSpec:
    """A parsed spec: ``text`` is its normal form (sorted, canonical names), the cache key and the name shown."""

    text: str
    requirements: tuple[str, ...]
    names: tuple[str, ...]  # canonical package names, in the order of ``requirements``


@dataclass
class BuiltEnv:
    spec: str
    python: str
    path: Path
    packages: dict[str, str]  # every distribution the layer holds: name -> exact version
    seconds: float  # how long the build took (the original build's, when reused)
    reused: bool
    import_error: str = ""  # torch and torchao cannot both be imported there (a torch this torchao does not run on)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def is_spec(value: str) -> bool:
    """A version spec (``pkg==1.2``, ``a==1,b>=2``) rather than the path of an interpreter."""
    return "/" not in value and "\\" not in value and any(op in value for op in ("==", ">=", "<=", "~=", "!=", "<", ">"))


def parse_spec(text: str, option: str = "--verify-env") -> EnvSpec:
    """``diffusers==0.39.0``, ``torchao==0.17.*``, ``transformers==4.57.6,diffusers==0.39.0``; every package
    needs a version constraint, each package once. ``option`` names the option in an error."""
    from packaging.requirements import InvalidRequirement, Requirement

    # split on the commas that start a new package (a comma inside "pkg>=1,<2" is followed by an operator)
    parts = [p.strip() for p in re.split(r",(?=\s*[A-Za-z])", text) if p.strip()]

    def bad(part: str, why: str) -> UsageError:
        where = f"{option} {text!r}" + (f" ({part!r})" if part != text.strip() else "")
        return UsageError(f"{where}: {why}")

    reqs: dict[str, str] = {}
    for part in parts:
        try:
            req = Requirement(part)
        except InvalidRequirement:
            raise bad(part, "not a version spec; write it like diffusers==0.39.0") from None
        if req.url or req.marker:
            raise bad(part, "only a package name and versions are allowed, like diffusers==0.39.0")
        if not str(req.specifier):
            raise bad(part, f"{req.name} has no version; pin one, like {req.name}==1.2.3")
        name = canonical(req.name)
        if name in reqs:
            raise bad(part, f"{req.name} is named twice; name each package once")
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        reqs[name] = f"{name}{extras}{req.specifier}"
    if not reqs:
        raise UsageError(f"{option}: empty spec; give a version spec like diffusers==0.39.0")
    names = tuple(sorted(reqs))
    return EnvSpec(",".join(reqs[n] for n in names), tuple(reqs[n] for n in names), names)


def envs_root() -> Path:
    from huggingface_hub import constants

    return Path(os.environ.get("HF_AO_PUBLISH_ENVS") or Path(constants.HF_HOME) / "hf-ao-publish" / "envs")


def parent_site_dirs() -> list[str]:
    """This environment's site-packages folders, in order (a venv's, then the system's when it includes them)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def installed_versions(paths: Iterable[str] | None = None) -> dict[str, str]:
    """name -> version of every distribution on ``paths`` (default: this interpreter's path); first one wins."""
    out: dict[str, str] = {}
    for dist in (md.distributions(path=list(paths)) if paths is not None else md.distributions()):
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonical(name), dist.version)
    return out


def cache_key(spec: EnvSpec) -> str:
    """The spec and everything about this environment a layer depends on: it is rebuilt when either changes."""
    parent = {
        "spec": spec.text,
        "python": sys.version,
        "executable": sys.executable,
        "site": parent_site_dirs(),
        "installed": sorted(installed_versions(parent_site_dirs()).items()),
    }
    return hashlib.sha256(json.dumps(parent, sort_keys=True).encode()).hexdigest()[:16]


def _folder_name(spec: EnvSpec, key: str) -> str:
    return f"{re.sub(r'[^A-Za-z0-9.]+', '-', spec.text).strip('-')[:60]}-{key}"


def built_folder(python: str) -> Path | None:
    """The folder of the built environment ``python`` is the interpreter of (its record there), whose packages never
    change once built; None for any other interpreter (a user's, which may change)."""
    folder = Path(python).parent.parent  # <root>/<name>/bin/python (layer_python)
    return folder if (folder / RECORD).is_file() else None


def zygote_notes(python: str) -> Path | None:
    """Where runs keep the import lists a zygote of ``python`` could not make (runtime/zygotes.py ``run``'s
    ``remember``: transformers 4.57's environment cannot import diffusers): a built environment's folder only."""
    folder = built_folder(python)
    return folder / ZYGOTE_NOTES if folder is not None else None


def layer_python(folder: Path) -> Path:
    return folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def build(spec: EnvSpec, root: Path | None = None, *, unasked: bool = False) -> BuiltEnv:
    """The environment for ``spec``: reused from the cache when built before, else built now. ``unasked`` (a version
    nobody named, the matrix's newest releases): a torch only in its CPU build on a machine without CUDA
    (torch_sources), never PyPI's CUDA build; and a failure is kept beside the entries for a day (UNBUILDABLE), so that
    later runs do not try again."""
    root = root or envs_root()
    key = cache_key(spec)
    final = root / _folder_name(spec, key)
    cached = _load(final, spec)
    if cached is not None:
        log.info("verification environment %s: reusing %s", spec.text, final)
        return cached
    if not unasked:
        return _build_new(spec, root, final)
    remembered = _remembered_failure(root, spec, key)
    if remembered:
        raise EnvBuildError(f"cannot build the verification environment {spec.text}: {remembered}")
    try:
        return _build_new(spec, root, final, heavy_torch=False)
    except EnvBuildError as exc:
        _remember_failure(root, spec, key, str(exc).removeprefix(f"cannot build the verification environment {spec.text}: "))
        raise


def _remembered_failure(root: Path, spec: EnvSpec, key: str) -> str:
    entry = keptfile.read(root / UNBUILDABLE, UNBUILDABLE_TTL_S).get(spec.text)
    if entry is None or entry.get("key") != key:
        return ""
    return f"{entry.get('reason', '')} (remembered from {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(entry['at']))})"


def _remember_failure(root: Path, spec: EnvSpec, key: str, reason: str) -> None:
    keptfile.keep(root / UNBUILDABLE, {spec.text: {"reason": reason, "key": key}}, UNBUILDABLE_TTL_S)


def _build_new(spec: EnvSpec, root: Path, final: Path, heavy_torch: bool = True) -> BuiltEnv:
    """Build the entry in a temporary folder, then rename it into place with its record written last."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".building-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.monotonic()
    log.info("building verification environment %s (this environment with only %s replaced) in %s",
             spec.text, ", ".join(spec.names), final)
    try:
        packages, downloads = _build_into(tmp, spec, heavy_torch)
        import_error = _import_error(tmp, {**installed_versions(), **packages})
        seconds = round(time.monotonic() - started, 1)
        record = {"spec": spec.text, "packages": packages, "seconds": seconds, "parent": sys.prefix,
                  "python": sys.version.split()[0], "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "downloads": downloads, "import_error": import_error}
        (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        theirs = _install(tmp, final, spec)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EnvBuildError(f"cannot build the verification environment {spec.text} in {root}: "
                            f"{exc.strerror or exc}; free disk space or set HF_AO_PUBLISH_ENVS to another folder") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if theirs is not None:
        return theirs
    log.info("verification environment %s built in %.1f s: %s", spec.text, seconds,
             ", ".join(f"{k} {v}" for k, v in sorted(packages.items())))
    if import_error:
        log.warning("verification environment %s: %s", spec.text, import_error)
    return BuiltEnv(spec.text, str(layer_python(final)), final, packages, seconds, reused=False, import_error=import_error)


def _install(tmp: Path, final: Path, spec: EnvSpec) -> BuiltEnv | None:
    """Rename the finished entry into place. Another run may have finished the same entry meanwhile: use
    theirs (returned). A broken leftover in the way (no record, no interpreter) is replaced."""
    try:
        tmp.rename(final)
        return None
    except OSError:
        theirs = _load(final, spec)
        if theirs is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return theirs
    shutil.rmtree(final)
    tmp.rename(final)
    return None


def _load(folder: Path, spec: EnvSpec) -> BuiltEnv | None:
    record_file = folder / RECORD
    if not record_file.is_file() or not layer_python(folder).exists():
        return None
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError):
        return None
    if record.get("spec") != spec.text:
        return None
    return BuiltEnv(spec.text, str(layer_python(folder)), folder, dict(record.get("packages") or {}),
                    float(record.get("seconds") or 0.0), reused=True, import_error=str(record.get("import_error") or ""))


def make_layer(folder: Path, spec: EnvSpec) -> tuple[Path, str]:
    """An empty layer over this environment in ``folder``: a venv without pip whose ``PTH`` appends this environment's
    site-packages after its own. Its interpreter and its own site-packages folder."""
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt", clear=True).create(folder)
    python = layer_python(folder)
    own_site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], spec, "inspect").strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in parent_site_dirs()]
    Path(own_site, PTH).write_text("\n".join(lines) + "\n")
    return python, own_site


def _build_into(folder: Path, spec: EnvSpec, heavy_torch: bool = True) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The layer's packages (name -> version) and what pip downloaded for it (name, version, url, bytes)."""
    try:
        import pip  # noqa: F401 - the layer runs this environment's pip
    except ImportError:
        raise EnvBuildError(f"cannot build the verification environment {spec.text}: this environment has no pip "
                            "(python -m pip); install pip, or pass the path of a Python interpreter to --verify-env") from None
    python, own_site = make_layer(folder, spec)
    constraints = folder / "constraints.txt"
    current = installed_versions()
    pins = [f"torch=={current['torch']}"] if "torch" in current and "torch" not in spec.names else []
    constraints.write_text("".join(f"{p}\n" for p in pins))
    report = folder / "pip-report.json"
    base = [str(python), "-m", "pip", "install", "--no-compile", "--no-input", "--disable-pip-version-check", "--no-warn-script-location",
            "--no-warn-conflicts", "-c", str(constraints), "--report", str(report)]
    tries = torch_sources.attempts(spec.requirements, fallback=heavy_torch) if "torch" in spec.names else [torch_sources.Attempt(list(spec.requirements), [], "")]
    for i, attempt in enumerate(tries):
        last = i == len(tries) - 1
        if attempt.note:
            log.info("verification environment %s: %s", spec.text, attempt.note)
        try:
            _run([*base, *attempt.options, *attempt.requirements], spec, "pip install")
            break
        except EnvBuildError:
            if last:
                raise
    packages = installed_versions([own_site])
    missing = [n for n in spec.names if n not in packages]
    if missing:  # pip found this environment's version good enough ("==0.18.*" with 0.18.0 here): nothing replaced
        raise EnvBuildError(f"the verification environment {spec.text} is this environment for {', '.join(missing)} "
                            f"(already {', '.join(f'{n} {current.get(n)}' for n in missing)}); "
                            "pin another version, or leave it out: this environment is always checked")
    _check_shadowing(python, own_site, spec)
    downloads = _downloads(report)
    if downloads:
        log.info("verification environment %s: pip installed %s (%s on disk)", spec.text,
                 "; ".join(f"{d['name']} {d['version']} from {d['source']}" for d in downloads),
                 f"{sum(f.stat().st_size for f in Path(own_site).rglob('*') if f.is_file()) / 1e6:,.0f} MB")
    return packages, downloads


def _downloads(report: Path) -> list[dict[str, str]]:
    """What pip's installation report says it installed: name, version and where from (a host or a local folder)."""
    from urllib.parse import urlparse

    try:
        items = json.loads(report.read_text()).get("install") or []
    except (OSError, ValueError):
        return []
    out = []
    for item in items:
        url = (item.get("download_info") or {}).get("url", "")
        parsed = urlparse(url)
        source = parsed.netloc or str(Path(parsed.path).parent) if url else "?"
        meta = item.get("metadata") or {}
        out.append({"name": canonical(str(meta.get("name", "?"))), "version": str(meta.get("version", "?")), "source": source})
    return out


def _import_error(folder: Path, versions: dict[str, str]) -> str:
    """One line when the layer's torch and torchao cannot be imported together (a torch this torchao was not built
    for), else "": the matrix then shows that in one row instead of a crash in every load."""
    code = "import torch, torchao; print(torch.__version__, torchao.__version__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHOME"}
    try:
        proc = subprocess.run([str(layer_python(folder)), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"importing torch and torchao there failed ({exc})"
    if proc.returncode == 0:
        return ""
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    error = next((line for line in reversed(lines) if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)), lines[-1] if lines else "no output")
    return (f"torch {versions.get('torch', '?')} cannot import torchao {versions.get('torchao', '?')}: {error[:240]}")


def _check_shadowing(python: Path, own_site: str, spec: EnvSpec) -> None:
    """A package this environment installs in editable mode (a meta-path finder) would win over the layer's copy."""
    code = ("import importlib.util, json, sys\nout = {}\nfor n in sys.argv[1:]:\n"
            "    s = importlib.util.find_spec(n)\n    out[n] = s.origin if s and s.origin else None\nprint(json.dumps(out))")
    found = json.loads(_run([str(python), "-c", code, *(n.replace("-", "_") for n in spec.names)], spec, "inspect"))
    root = str(Path(own_site).resolve())
    for module, origin in found.items():
        if origin and not str(Path(origin).resolve()).startswith(root):
            raise EnvBuildError(f"the verification environment {spec.text}: {module} still imports from {origin} "
                                "(an editable install in this environment shadows it); uninstall that, or pass an interpreter")


def _run(cmd: list[str], spec: EnvSpec, what: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "PIP_TARGET", "PIP_PREFIX", "PIP_USER")}
    env["PIP_NO_INPUT"] = "1"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvBuildError(f"cannot build the verification environment {spec.text}: {what} failed ({exc})") from None
    if proc.returncode != 0:
        raise EnvBuildError(f"cannot build the verification environment {spec.text}: {what} failed: {_pip_reason(proc.stderr)}; "
                            "check the spec and access to the package index (PyPI)")
    return proc.stdout


def _pip_reason(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    # pip's informational lines ("Ignored the following yanked versions", "Could not find a version ... (from
    # versions: <hundreds>)") come before the reason ("No matching distribution found for ...")
    errors = [line for line in errors if "(from versions:" not in line and "Ignored the following" not in line] or errors
    line = (errors[0] if errors else (lines[-1] if lines else "no output"))
    return line.removeprefix("ERROR: ")[:300]
