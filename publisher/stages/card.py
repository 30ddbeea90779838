"""Stage 5: the model card: typed metadata (ModelCardData) + a jinja2 template shipped with the package.

The template renders with StrictUndefined, so a missing value is a bug caught by tests, not a blank
in a published card. Licence fields are copied from the base card, never invented.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher import __version__, adapters
from publisher.handoffs.artifacts import Artifacts
from publisher.handoffs.plan import DENOISERS, Plan
from publisher.handoffs.report import VerifyReport
from publisher.runtime import logs
from publisher.stages import card_config
from publisher.stages.card_usage import manual_functions, usage
from publisher.verify import claims

if TYPE_CHECKING:
    from publisher.quality.grid import GridFigures
    from publisher.quality.lm import LmFigures

TEMPLATE_NAME = "modelcard.md.j2"
COMPAT_TEMPLATE = "compatibility.md.j2"  # its Software requirements and Compatibility sections (recheck renders them alone)
_LICENSE_FILE_PREFIXES = ("LICENSE", "LICENCE", "NOTICE")


def template_path() -> Path:
    """The card template: inside the installed package, or templates/ at the root of a source checkout."""
    package = Path(__file__).resolve().parent.parent  # publisher/
    for candidate in (package / "templates" / TEMPLATE_NAME, package.parent / "templates" / TEMPLATE_NAME):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"card template {TEMPLATE_NAME} is missing from the installation; reinstall hf-ao-publish")


@dataclass
class CardInputs:
    """What the card needs beyond the plan and the artifacts."""

    command: str  # the exact command line (token never included)
    sample: dict[str, Any] = field(default_factory=lambda: {"prompt": "a photo of a cat", "steps": 28, "size": 1024})
    variants: list[dict[str, Any]] = field(default_factory=list)  # sibling repos of a multi-recipe run
    produced_on: str = "cpu"
    quality: Any = None  # publisher.quality figures: lm.LmFigures, grid.GridFigures, or None
    evaluation: Any = None  # publisher.quality.options.Settings (None: the evaluation was off)
    extra_notes: list[str] = field(default_factory=list)
    benchmark: dict[str, Any] | None = None  # publisher.stages.measure.measure()
    shard_note: str | None = None  # the output shards are not the library's default size


def licence_fields(plan: Plan) -> tuple[dict[str, Any], str | None]:
    """(YAML licence fields, note). Relative links become absolute URLs on the base repo."""
    data = plan.source.card_data
    lic = data.get("license")
    if not lic or not isinstance(lic, str):
        return {"license": "other"}, "The base model's licence could not be read; check the base repository before use."
    fields = {"license": lic}
    if isinstance(data.get("license_name"), str):
        fields["license_name"] = data["license_name"]
    link = data.get("license_link")
    if isinstance(link, str) and link:
        if not link.startswith(("http://", "https://")):
            base_url = plan.source.url()
            if base_url:
                link = f"{base_url}/blob/{plan.source.sha}/{link.lstrip('./')}"
        fields["license_link"] = link
    return fields, None


def licence_files(plan: Plan) -> list[str]:
    return [f for f in plan.base_files if "/" not in f and f.upper().startswith(_LICENSE_FILE_PREFIXES)]


def card_data(plan: Plan, artifacts: Artifacts) -> Any:
    from huggingface_hub import ModelCardData

    lic, _ = licence_fields(plan)
    base_tags = [t for t in plan.source.card_data.get("tags") or [] if isinstance(t, str)]
    recipe = artifacts.recipe
    what = [recipe.name] if recipe.named else sorted({type(c).__name__ for s in recipe.specs() for c in [s.config]})
    tags = list(dict.fromkeys(["torchao", *what, "hf-ao-publish", "quantized", *base_tags]))
    return ModelCardData(
        base_model=plan.source.repo_id,
        base_model_relation="quantized",
        library_name=plan.library_name,
        pipeline_tag=plan.pipeline_tag,
        tags=tags,
        **lic,
    )


# Class names read aloud: an initialism letter by letter (NF4Tensor: "en-eff"), a word as a word (Int8Tensor, but
# UintxTensor: "you-int"); "an" before the vowel sounds
_INITIALISM = re.compile(r"^[A-Z](?:[A-Z]|\d)")
_VOWEL_LETTERS = set("AEFHILMNORSX")  # the letters whose names start with a vowel sound
_YOU = re.compile(r"^u(?:ni|int|s[aeiou]|til|r[aeiou])", re.I)  # words that start with a "you" sound


def classes_text(classes: list[str] | tuple[str, ...]) -> str:
    """What every quantized layer must come back as, in the card's words: "an `Int8Tensor`"."""
    if not classes:
        return "a torchao tensor"
    return " or ".join(f"{article(c)} `{c}`" for c in classes) + (" (as its config implies)" if len(classes) > 1 else "")


def article(word: str) -> str:
    """The indefinite article before ``word`` (a class name): "an" for ``Int8Tensor``, ``NF4Tensor``, "a" for
    ``Float8Tensor``, ``UintxTensor``."""
    if _INITIALISM.match(word):
        return "an" if word[0] in _VOWEL_LETTERS else "a"
    if _YOU.match(word):
        return "a"
    return "an" if word[:1].lower() in "aeiou" else "a"


def human_size(n: int | float | None) -> str:
    """Bytes in decimal units, as the card and the CLI's tables show them (2.50 MB)."""
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _cell(text: Any) -> str:
    """Text for one markdown table cell: pipes escaped, line breaks (every kind) shown as a symbol, other control
    characters as the replacement character, nothing empty."""
    value = " ⏎ ".join(str(text).splitlines())
    value = "".join(ch if ch.isprintable() else "\ufffd" for ch in value)
    value = value.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`").strip()
    return value or "(nothing)"


@functools.cache
def environment() -> Any:
    """The jinja2 environment cards render in: undefined variables are errors, not blanks. One per process, as
    jinja2 means it: it compiles a template once and keeps it (its loader reads the file again when it changes);
    compiling the card's template is ~0.1 s of CPU, paid by every card before (a publish renders several)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(template_path().parent), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["human"] = human_size
    env.filters["cell"] = _cell
    return env


def render(plan: Plan, artifacts: Artifacts, report: VerifyReport, target: str | None, inputs: CardInputs,
           folder: Path | None = None) -> str:
    """The card. ``target``: the repo id a push would use (None: none chosen; the snippets then load ``folder``)."""

    recipe = artifacts.recipe
    data = card_data(plan, artifacts)
    _, licence_note = licence_fields(plan)
    files = artifacts.files()
    current = next((r.versions for r in report.results if r.env == "current" and r.versions), {})
    first = artifacts.components[0]
    template = environment().get_template(TEMPLATE_NAME)
    config = card_config.section(recipe, artifacts, plan.kind, plan.source.name)
    causal = plan.kind != "pipeline" and adapters.of(first.library).causal_lm(first.class_name)
    manual = [r for r in report.results if r.path == "manual" and r.component == first.name and r.env == "current"]
    compat = claims.summarise(report, {c.library for c in artifacts.components})
    text = template.render(
        card_data=data.to_yaml(),
        title=f"{plan.source.name.split('/')[-1]} (torchao {recipe.title})",
        repo_id=target or str(folder or artifacts.folder),
        target_chosen=target is not None,
        usage=usage(plan.pipeline_class, int(inputs.sample["size"]), int(inputs.sample["steps"])) if plan.kind == "pipeline" else None,
        manual_code=manual_functions(first.library),
        manual_not_applicable=next((r.detail for r in manual if not r.applicable), None),
        layers=artifacts.layers,
        weights_only=report.weights_only(),
        base={
            "repo_id": plan.source.repo_id,
            "sha": plan.source.sha,
            "url": plan.source.url(),
            "name": plan.source.name,  # a local folder by its name, never its path
        },
        kind=plan.kind,
        pipeline_class=plan.pipeline_class or "",
        recipe=recipe,
        config=config,
        classes_text=classes_text(config.classes),
        quantized=artifacts.components,
        kept=[c for c in plan.kept if c.class_name],
        exclude=list(plan.exclude),
        sizes={c.label: (c.bytes_before, c.bytes_after) for c in artifacts.components},
        total_download=sum(files.values()),
        weight_bytes=sum(size for name, size in files.items() if name.endswith(".safetensors")),  # every component's
        files=files,
        report=report,
        versions=current,
        licence_note=licence_note,
        artifact_notes=artifacts.notes,
        licence_files=licence_files(plan),
        auto_class="AutoModelForCausalLM" if causal else "AutoModel",
        causal=causal,
        tokenizer=plan.kind == "pipeline" or plan.source.has_tokenizer,  # else the snippets feed token ids
        inputs=inputs,
        tool_version=__version__,
        compat=compat,
        compat_table=claims.table(compat),
        compat_warnings=claims.warnings(compat),
        compat_manual=claims.manual_text(compat),
        harmless=logs.card_lines(plan.kind),
        compile_target=next((c.name for c in artifacts.components if c.name in DENOISERS), first.name),
        # torch 2.13: compiled int8 weight-only matmuls go to a CPU kernel that crashes on unaligned rows (as weights read
        # from safetensors can be); the compile snippet turns inductor's pattern matcher off on a CPU for these
        cpu_compile_without_pattern_matcher="Int8Tensor" in recipe.tensor_classes,
        bytes_before=sum(c.bytes_before for c in artifacts.components),
        bytes_after=sum(c.bytes_after for c in artifacts.components),
        bench=_bench_summary(inputs.benchmark),
    )
    # Template blocks leave runs of blank lines; collapse them (no fenced block holds two blank lines).
    return re.sub(r"\n{3,}", "\n\n", text)


def _bench_summary(benchmark: dict[str, Any] | None) -> list[str]:
    """One phrase per component that --benchmark measured: eager latency, quantized against bf16."""
    out = []
    for row in (benchmark or {}).get("rows", []):
        q, b = row.get("quantized", {}).get("eager_ms"), row.get("bf16", {}).get("eager_ms")
        if q and b:
            where = benchmark.get("gpu", "the CPU") if benchmark else "the CPU"
            out.append(f"{row['component']}: {q:.1f} ms against {b:.1f} ms in bf16 ({b / q:.2f}x) on {where}")
    return out


def shard_note(artifacts: Artifacts, shard_size: int | None) -> str | None:
    """What the card says when the weights are split into shards of another size than the library's default."""
    import inspect

    if shard_size is None:
        return None
    defaults = []
    for c in artifacts.components:
        cls = getattr(__import__(c.library), c.class_name, None)
        default = inspect.signature(cls.save_pretrained).parameters["max_shard_size"].default if cls is not None else "?"
        defaults.append(f"{c.label}: {default}")
    return (f"The weights are split into safetensors shards of at most {human_size(shard_size)} (`--max-shard-size`; "
            f"`save_pretrained`'s default is {', '.join(defaults)}). Only the shard boundaries differ from the library's "
            "layout: which file holds which tensor, and the index. Every tensor, its header entry and metadata, and "
            "every config are what `save_pretrained` writes, and the library loaders read the shards as usual.")


@dataclass(frozen=True)
class Built:
    """One built recipe, as its card reads it: what was made and verified, and what was measured."""

    artifacts: Artifacts
    report: VerifyReport
    quality: Any = None  # publisher.quality figures (None: not evaluated)
    benchmark: dict[str, Any] | None = None  # publisher.stages.measure.measure()
    folder: Path | None = None  # its final repo folder (the snippets' local path), once known


@dataclass(frozen=True)
class CardSettings:
    """What every card of a run shares."""

    command: str  # the exact command line (token never included)
    sample: dict[str, Any]  # the snippet's prompt (None: the kind's default), steps and size
    endpoint: str  # the Hub the variants' links point to
    evaluation: Any = None  # publisher.quality.options.Settings (None: the evaluation was off)
    shard_size: int | None = None  # the output shard size, when it is not the library's default


def write_cards(plan: Plan, built: dict[str, Built], settings: CardSettings, only: str | None = None) -> list[Path]:
    """Cards are written once every recipe is done, so each can link to its sibling variants. ``only``: rewrite
    one recipe's card and report (after a later check). Returns the files written."""
    variants = []
    if len(built) > 1:
        for name, b in built.items():
            target = plan.targets[name]
            variants.append({
                "recipe": name, "repo_id": target,  # None: none chosen (--no-push), so no link
                "url": f"{settings.endpoint}/{target}" if target else "",
                "size": sum(b.artifacts.files().values()), "runs_on": b.artifacts.recipe.run.describe(),
                "quality": _variant_quality(b.quality, b.report),
            })
    default_prompt = "a photo of a cat" if plan.kind == "pipeline" else "The capital of France is"
    written: list[Path] = []
    for name, b in built.items():
        if only is not None and name != only:
            continue
        inputs = CardInputs(
            command=settings.command,
            sample={**settings.sample, "prompt": settings.sample.get("prompt") or default_prompt},
            variants=variants,
            produced_on=_produced_on(b.artifacts),
            benchmark=b.benchmark,
            extra_notes=_fp8_cpu_notes(b.artifacts),
            quality=b.quality,
            evaluation=settings.evaluation,
            shard_note=shard_note(b.artifacts, settings.shard_size),
        )
        text = render(plan, b.artifacts, b.report, plan.targets[name], inputs, b.folder)
        (b.artifacts.folder / "README.md").write_text(text, encoding="utf-8")
        written += [b.artifacts.folder / "README.md", b.report.write(b.artifacts.folder)]
    return written


def _variant_quality(figures: LmFigures | GridFigures | None, report: VerifyReport) -> str:
    """One recipe's quality in the table of sibling variants: its perplexity recovery or lowest grid PSNR, else the
    verification's relative error."""
    recovery = getattr(figures, "recovery", None)
    if recovery is not None:
        return f"perplexity recovery {recovery:.2f}%"
    psnr = getattr(figures, "psnr", None)
    if psnr:
        return f"PSNR {min(psnr):.2f} dB (lowest of the grid)"
    return ", ".join(f"{q.component} rel. error {q.rel_error:.4f}" for q in report.quality) or "n/a"


def _produced_on(artifacts: Artifacts) -> str:
    if artifacts.device != "cuda":
        return "CPU"
    import torch

    cc = ".".join(map(str, torch.cuda.get_device_capability()))
    return f"{torch.cuda.get_device_name()} (compute capability {cc})"


def _fp8_cpu_notes(artifacts: Artifacts) -> list[str]:
    """What the card must say about GPU-recipe weights made on a CPU (publisher/fp8cpu.py)."""
    if artifacts.device == "cuda" or not artifacts.recipe.quantize.cuda:
        return []
    checks = [c.fp8_check for c in artifacts.components if c.fp8_check]
    worst = max((c["worst_ratio"] for c in checks), default=0.0)
    return [
        "These FP8 weights were produced on a CPU: torchao's own FP8 handler ran without its GPU "
        "assertion (publisher/fp8cpu.py), which gives the same bytes as on a GPU without the mslk kernels. "
        f"Every dequantized weight is within the e4m3 error bound of the bf16 base (worst {worst:.2f} of the bound, "
        f"{sum(c['checked'] for c in checks)} weights). Running them with FP8 speed-ups needs {artifacts.recipe.run.describe()}."
    ]
