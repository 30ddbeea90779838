"""Stage 1: validate the whole job and turn it into a Plan before anything heavy happens.

Checks run in the order a user would want them answered (recipe syntax and hardware first, then the
base repo, its layout, components and exclusions). Components are built on the meta device so
module names, Linear counts and sizes are known without reading a weight.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from publisher import adapters, recipe_args
from publisher.errors import SourceError, TargetError, UsageError
from publisher.handoffs.plan import DENOISERS, Component, Plan, Source
from publisher.io import hub
from publisher.io.jsonfile import weight_map
from publisher.io.localfiles import plain_name
from publisher.io.tokens import TokenRights
from publisher.quality.options import check_applicable
from publisher.quality.stage import check_measurable, kind_of
from publisher.recipes import Recipe, check_can_quantize
from publisher.request import PublishRequest
from publisher.stages import layercheck, prequantized
from publisher.stages.basecheck import check_base
from publisher.stages.push import check_writable
from publisher.stages.source import check_named_folder, read_json, resolve
from publisher.stages.unfinished import check_output_dir
from publisher.verify import matrix

log = logging.getLogger(__name__)

_TARGET_RE = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def make_plan(req: PublishRequest, token: str | None, *, check_hardware: bool = True) -> Plan:
    """Everything that can fail cheaply fails here, before any weight is downloaded, in the order a user wants it
    answered: the recipes' syntax and hardware, the environments, the target id, the folders, then the base.
    ``check_hardware=False`` when the job runs elsewhere (Hugging Face Jobs: the flavor is checked instead)."""
    units = recipe_args.precheck(req.make.quant, req.make.layer_config, check_hardware=check_hardware)  # no torchao yet
    components = mapped_components(units, req.base.components)
    components_from = "--quant" if components and not req.base.components else "--components"
    matrix.check(req.checks.verify_envs, req.checks.compat)
    if req.target.repo_id:
        check_target_id(req.target.repo_id.replace("{recipe}", "x"))
    check_named_folder(req.base.model)
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE  # an air-gapped run: nothing of ours asks the Hub
    if req.target.push and offline:
        raise TargetError("HF_HUB_OFFLINE is set and pushing needs the Hub; unset HF_HUB_OFFLINE, or use --no-push")
    if req.target.push and not token:
        raise TargetError("pushing needs a Hub token with write access; set HF_TOKEN (or pass --token), or use --no-push")
    if req.target.output_dir is not None:
        check_output_dir(req.target.output_dir)
    src = resolve(req.base.model, req.base.revision, token)
    user, who = None, None  # before any file of the base is read: a gated base needs the token's gated access
    if token and not offline:  # offline (no push): no default repo id is asked for, the card says none was chosen
        who = hub.call(hub.client(token).whoami, what="checking the token")
        user = who.get("name")
        if src.gated and src.repo_id and (reason := TokenRights.of(who).gated_reason(src.repo_id)) is not None:
            raise SourceError(reason)
    layout = check_layout(src, components, token, req.base.trust_remote_code, components_from)  # model_index.json alone
    recipes = recipe_args.parse(req.make.quant, req.make.layer_config)  # torchao reads every config: one it rejects stops here
    for recipe in recipes if check_hardware else ():
        check_can_quantize(recipe)
    targets = target_ids(src, recipes, req.target.repo_id, user)
    options = {"components": req.base.components, "exclude": req.base.exclude}
    plan = build_plan(
        src, layout, recipes, components=components, exclude=list(req.base.exclude), targets=targets, token=token,
        trust_remote_code=req.base.trust_remote_code, options=options, components_from=components_from,
    )
    plan = replace(plan, options={**options, "card": req.card_options(plan.kind)})
    if req.checks.evaluation is not None:  # a bound on a figure this model has not, or cannot get: a usage error, before any download
        check_applicable(req.checks.evaluation.bounds, kind_of(plan), f"{req.base.model} ({plan.quantized[0].class_name})")
        check_measurable(req.checks.evaluation, plan, token)
    if req.target.push:  # after the base checks, in the order the preflight promises
        assert token is not None  # a push without one was refused above
        for target in targets.values():
            check_writable(str(target), token, who)  # a push has a token, so every target is named
    return plan



def mapped_components(units: list[tuple[str, ...]], components: list[str] | None) -> list[str] | None:
    """The components a run quantizes: --components (or the default), or those a per-component --quant names
    (``units``: each --quant unit's mapped components, empty for one config). Every recipe of one run quantizes the
    same components (one plan, one download)."""
    mapped = [m for m in units if m]
    if not mapped:
        return components
    first = mapped[0]
    if any(set(m) != set(first) for m in mapped) or len(mapped) != len(units):
        raise UsageError("every --quant of one run must quantize the same components: "
                         + "; ".join(", ".join(m) if m else "the --components (or the denoiser)" for m in units)
                         + "; run them separately")
    if components and set(components) != set(first):
        raise UsageError(f"--components {','.join(components)} contradicts --quant, which names {', '.join(first)}; "
                         "drop --components (a per-component --quant chooses them)")
    return list(first)


def check_target_id(repo_id: str) -> str:
    if not _TARGET_RE.match(repo_id) or ".." in repo_id or "--" in repo_id or repo_id.endswith((".git", ".")):
        raise UsageError(f"--repo-id {repo_id!r} is not a valid Hub repo id; use NAMESPACE/NAME (letters, digits, '-', '_', '.')")
    return repo_id


def target_ids(source: Source, recipes: list[Recipe], repo_id: str | None, user: str | None) -> dict[str, str | None]:
    """Default target: <token user>/<base name>-torchao-<recipe>; None when there is neither a --repo-id nor a token
    to ask whose it would be (only possible with --no-push). With several recipes an explicit --repo-id gets
    "-<recipe>" appended unless it contains "{recipe}"."""
    out: dict[str, str | None] = {}
    base_name = source.name.split("/")[-1]
    for recipe in recipes:
        if repo_id:
            if "{recipe}" in repo_id:
                rid = repo_id.replace("{recipe}", recipe.name)
            elif len(recipes) > 1:
                rid = f"{repo_id}-{recipe.name}"
            else:
                rid = repo_id
        elif user:
            rid = f"{user}/{base_name}-torchao-{recipe.name}"
        else:
            out[recipe.name] = None
            continue
        out[recipe.name] = check_target_id(rid)
    return out


class Layout(NamedTuple):
    """What model_index.json (or config.json) says the base is: read once, before any library is imported."""

    kind: str  # "pipeline" | "transformers"
    pipeline_class: str | None
    components: list[tuple[str, str, str]]  # (component name, library, class name)


def detect_layout(source: Source, token: str | None, trust_remote_code: bool) -> Layout:
    """The base's Layout, from model_index.json or config.json."""
    files = set(source.sizes)
    if "model_index.json" in files:
        index = read_json(source, "model_index.json", token)
        where = source.where("model_index.json")
        pipeline_class = index.get("_class_name")
        if isinstance(pipeline_class, list):  # [module, class] means a custom (remote-code) pipeline
            _refuse_remote_code(source, f"custom pipeline {pipeline_class}", trust_remote_code)
            pipeline_class = pipeline_class[-1] if pipeline_class else None
        if not isinstance(pipeline_class, str):
            raise SourceError(f"{where}: _class_name is {pipeline_class!r}, not a pipeline class name; fix the file")
        comps: list[tuple[str, str, str]] = []
        for name, value in index.items():
            if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] is None:
                continue  # diffusers reads the rest as pipeline options (e.g. requires_safety_checker)
            if not plain_name(name):
                raise SourceError(f"{where} names a component {name!r}, which is not a plain folder name; "
                                  "refusing it (a component must be a folder of the base)")
            library, class_name = value
            if not isinstance(library, str) or not isinstance(class_name, str):
                raise SourceError(f"{where}: component {name} is {value!r}, not [library, class name]; fix the file")
            if library not in adapters.LIBRARIES:
                _refuse_remote_code(source, f"component {name} from {library!r}", trust_remote_code)
            comps.append((name, library, class_name))
        return Layout("pipeline", pipeline_class, comps)
    if "config.json" in files:
        config = read_json(source, "config.json", token)
        if "_class_name" in config or "_diffusers_version" in config:
            raise SourceError(
                f"{source.display} is a single diffusers model ({config.get('_class_name')}), not a pipeline; "
                "publish the pipeline repo that contains it"
            )
        if "model_type" not in config and "architectures" not in config:
            raise SourceError(f"{source.display}: config.json has no model_type or architectures; it is not a transformers model")
        if config.get("auto_map"):
            _refuse_remote_code(source, "auto_map in config.json", trust_remote_code)
        archs = config.get("architectures") or ["AutoModel"]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise SourceError(f"{source.where('config.json')}: architectures is {archs!r}, not a list of class names; "
                              "fix the file")
        return Layout("transformers", None, [("", "transformers", archs[0])])
    raise SourceError(
        f"{source.display} is neither a diffusers pipeline (model_index.json) nor a transformers model (config.json)"
    )


def _refuse_remote_code(source: Source, what: str, trust: bool) -> None:
    if not trust:
        raise SourceError(
            f"{source.display} needs remote code ({what}); review that code, then re-run with --trust-remote-code"
        )


def _model_class(library: str, class_name: str) -> Any:
    """The torch model class of a component, or None when it is not a model (tokenizer, scheduler, a class of a
    library we have no adapter for)."""
    return adapters.of(library).model_class(class_name) if library in adapters.LIBRARIES else None


def weight_files(source: Source, folder: str) -> tuple[str, ...]:
    """Weights of one model folder: safetensors when present (never also .bin), no variants, no stray single files."""
    prefix = f"{folder}/" if folder else ""
    direct = [f for f in source.files if f.startswith(prefix) and "/" not in f[len(prefix):]]
    st = [f for f in direct if f.endswith(".safetensors") or f.endswith(".safetensors.index.json")]
    index = [f for f in st if f.endswith(".index.json")]
    if index:
        # a sharded checkpoint: exactly the shards its index names (read later) plus the index
        return tuple(sorted(index))
    standard = [f for f in st if Path(f).name in ("model.safetensors", "diffusion_pytorch_model.safetensors")]
    return tuple(standard or st[:1])


def build_plan(
    source: Source,
    layout: Layout,
    recipes: list[Recipe],
    *,
    components: list[str] | None,
    exclude: list[str],
    targets: dict[str, str | None],
    token: str | None,
    trust_remote_code: bool = False,
    options: dict[str, Any] | None = None,
    components_from: str = "--components",
) -> Plan:
    """``layout``: check_layout's (the component names already checked against it); ``components_from``: the option
    that chose ``components`` (a per-component --quant names them), for messages."""
    kind, pipeline_class, found = layout
    # an already-quantized base is refused first, by its configs (its weights' headers are read below)
    prequantized.refuse_quantized_configs(source, [name for name, _, _ in found], token)
    model_comps = {name: (lib, cls) for name, lib, cls in found if _model_class(lib, cls) is not None}
    if kind != "pipeline":  # one model, quantized whole
        if not model_comps:
            hint = ("models whose classes live in remote code are not supported yet" if trust_remote_code
                    else "upgrade transformers")
            raise SourceError(f"{source.display}: transformers has no model class {found[0][2]!r}; {hint}")
        chosen = [""]
    else:
        if components:
            chosen = list(dict.fromkeys(components))
            for name in chosen:  # every name is one of the index's (check_component_names)
                if name not in model_comps:
                    raise UsageError(
                        f"{components_from}: {name!r} is not a model and cannot be quantized; quantizable: "
                        f"{', '.join(sorted(model_comps))}"
                    )
        else:
            chosen = [d for d in DENOISERS if d in model_comps][:1]
            if not chosen:
                raise UsageError(
                    f"{source.display} has no transformer or unet; choose with --components from: {', '.join(sorted(model_comps))}"
                )

    comps: list[Component] = []
    for name, library, class_name in found:
        quantize = name in chosen
        files = weight_files(source, name) if name in model_comps else ()
        if quantize and not files:
            raise SourceError(f"{source.display}: component {name or 'model'} has no safetensors weights; only safetensors bases are supported")
        comps.append(Component(name=name, library=library, class_name=class_name, quantize=quantize, weight_files=files))
    base_files = _base_files(source, kind, comps, token)
    # Every file the run will parse, checked before the meta-device builds and any download or repo (basecheck).
    prequantized.refuse_quantized_tensors(source, check_base(source, base_files, token))
    comps = [_with_meta_structure(source, c, token) if c.quantize else c for c in comps]
    _check_excludes(exclude, [c for c in comps if c.quantize])
    quantized = [c for c in comps if c.quantize]
    recipes = [layercheck.bind(r, quantized) for r in recipes]
    for recipe in recipes:  # before any download: a layer torchao cannot quantize with its config, a stray pattern
        layercheck.check(recipe, quantized, exclude)

    pipeline_tag = source.card_data.get("pipeline_tag")
    library_name = "diffusers" if kind == "pipeline" else "transformers"
    return Plan(
        source=source,
        kind=kind,
        pipeline_class=pipeline_class,
        components=tuple(comps),
        recipes=tuple(recipes),
        exclude=tuple(exclude),
        targets=targets,
        base_files=tuple(base_files),
        library_name=library_name,
        pipeline_tag=pipeline_tag,
        trust_remote_code=trust_remote_code,
        options=options or {},
    )


def check_layout(source: Source, components: list[str] | None, token: str | None, trust_remote_code: bool,
                 components_from: str = "--components") -> Layout:
    """The base's layout and the component names, from model_index.json / config.json alone (no library imported):
    run before torchao reads the configs, so a misspelt component fails in seconds."""
    layout = detect_layout(source, token, trust_remote_code)
    check_component_names(source, layout.kind, [name for name, _, _ in layout.components], components, components_from)
    return layout


def check_component_names(source: Source, kind: str, names: list[str], components: list[str] | None,
                          what: str = "--components") -> None:
    """--components against the names model_index.json gives, as soon as it is read: a misspelt name fails in
    seconds, before the libraries are imported to tell models from tokenizers and schedulers."""
    if not components:
        return
    if kind != "pipeline":
        raise UsageError(f"{what} applies to diffusers pipelines; {source.display} is a transformers model (it is quantized "
                         "whole: give --quant one config)")
    import difflib

    for name in dict.fromkeys(components):
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"{what}: {source.display} has no component {name!r}{hint}; its model_index.json "
                             f"names: {', '.join(sorted(names))}")


def _check_excludes(exclude: list[str], quantized: list[Component]) -> None:
    for name in exclude:
        if not any(name in c.module_names for c in quantized):
            hint = ", ".join(sorted(c.linear_names[0] for c in quantized if c.linear_names)[:2])
            raise UsageError(
                f"--exclude {name!r} matches no module of the quantized components "
                f"({', '.join(c.label for c in quantized)}); give a full module name such as {hint}"
            )


def _with_meta_structure(source: Source, comp: Component, token: str | None) -> Component:
    """Build the component on the meta device to learn its modules without reading weights."""
    import torch

    library = adapters.of(comp.library)
    cls = library.model_class(comp.class_name)
    assert cls is not None  # checked by the caller
    config_path = f"{comp.name}/config.json" if comp.name else "config.json"
    model = library.build_meta(cls, read_json(source, config_path, token))
    linears = tuple(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    modules = frozenset(n for n, _ in model.named_modules() if n)
    # bf16 is the load dtype for every quantized component (2 bytes per parameter)
    nbytes = sum(p.numel() * 2 for p in model.parameters())
    shapes = tuple((n, m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    skips = library.default_skip_modules(model)
    return Component(
        name=comp.name, library=comp.library, class_name=comp.class_name, quantize=True,
        linear_names=linears, module_names=modules, param_bytes=nbytes, weight_files=comp.weight_files,
        linear_shapes=shapes, param_names=tuple(n for n, _ in model.named_parameters()), default_skips=skips,
    )


_TOKENIZER_LIKE = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "spiece.model", "tokenizer.model", "sentencepiece.bpe.model",
    "preprocessor_config.json", "processor_config.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "config.json", "scheduler_config.json", "model_index.json",
)


def _base_files(source: Source, kind: str, comps: list[Component], token: str | None) -> list[str]:
    """Exactly the files a standalone result needs: configs, tokenizers, scheduler, each model's
    weights (safetensors only), the base card and licence files. Never a root single-file checkpoint."""
    wanted: set[str] = {"README.md"} if "README.md" in source.sizes else set()
    wanted |= {f for f in source.files if "/" not in f and Path(f).stem.upper().startswith(("LICENSE", "LICENCE", "NOTICE"))}
    if kind == "pipeline":
        wanted.add("model_index.json")
    folders = [c.name for c in comps] if kind == "pipeline" else [""]
    for folder in folders:
        prefix = f"{folder}/" if folder else ""
        for f in source.files:
            rest = f[len(prefix):]
            if f.startswith(prefix) and "/" not in rest and (rest in _TOKENIZER_LIKE or (folder and rest.endswith((".json", ".txt", ".model", ".jinja")) and "index" not in rest)):
                wanted.add(f)
    for comp in comps:
        for wf in comp.weight_files:
            wanted.add(wf)
            if wf.endswith(".index.json"):
                shards = set(weight_map(read_json(source, wf, token), source.where(wf)).values())
                unsafe = sorted(s for s in shards if not plain_name(s))
                if unsafe:
                    raise SourceError(f"{source.display} has an unsafe file name {unsafe[0]!r} in {wf} (a shard must sit "
                                      "next to its index; this one escapes the folder); refusing to download it")
                base = str(Path(wf).parent) if "/" in wf else ""
                absent = sorted(s for s in shards if (f"{base}/{s}" if base else s) not in source.sizes)
                if absent:
                    raise SourceError(f"{source.where(wf)} names the shard {absent[0]}, which {source.display} does not "
                                      "have; the checkpoint is incomplete: fix the index or add the shard")
                for shard in sorted(shards):
                    wanted.add(f"{base}/{shard}" if base else shard)
    for f in sorted(wanted):
        if f.startswith("/") or ".." in Path(f).parts:
            raise SourceError(f"{source.display} has an unsafe file name {f!r} (escapes the folder); refusing to download it")
    missing = sorted(f for f in wanted if f not in source.sizes)
    if missing:
        raise SourceError(f"{source.display} is incomplete: {', '.join(missing[:3])} listed but not present")
    unhashed = sorted(f for f in wanted if source.repo_id and f not in source.hashes)
    if unhashed:  # refused before any weight is downloaded: nothing could prove its bytes are the base's
        raise SourceError(f"the Hub reported no sha256 or blob id for {unhashed[0]} of {source.display}, so its download "
                          "cannot be checked; use a Hub endpoint that reports file metadata (files_metadata)")
    return sorted(wanted)
