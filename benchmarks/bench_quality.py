"""Benchmark: what the quality evaluation (publisher/quality/) costs at Llama-3-8B and FLUX.1-dev size on this machine.

    python benchmarks/bench_quality.py [--lm] [--flux] [--layers 1] [--tokens 1024] [--workdir DIR]

Measured on shape-equivalent bases with fewer layers (random bf16 weights, every tensor of the real shapes), each
part in a fresh process, then projected to the whole model by its layer count (the per-layer figures scale
linearly: one layer's weights, the same tokens):

- ``--lm``: a Llama-3-8B-shaped checkpoint (hidden 4096, MLP 14336, 32/8 heads, vocabulary 128256) with ``--layers``
  decoder layers. The streaming engine quantizes it (int8wo) twice: alone, and with the perplexity pass riding
  along (verify/inpass.py, ``--tokens`` tokens in windows of 512), which a publish no longer does at this vocabulary.
  Then one greedy-continuation step and the perplexity after the pass, each alone; then, in one process as a publish
  runs them, the pass followed by the perplexity of both models and a continuation (the embedding and head read row
  by row): its peak RSS is the figure the 1.2 GiB bound is about. Peak RSS is the child's own VmHWM.
- ``--flux``: a FLUX.1-dev-shaped transformer with one double and one single block, called block by block from its
  files at the grid's smallest size (64 px: 16 image + 512 text tokens), each block timed; a one-layer T5-XXL encoder
  on 512 tokens; FLUX's VAE decoding a 64 px latent. The projection is one grid (6 images, 2 steps) and the lower bound
  the grid stage gives up on before it runs anything (quality/grid.py ``lower_bound``) for comparison.

Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA3_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
LLAMA3_8B_LAYERS = 32
FLUX_DOUBLE, FLUX_SINGLE, T5_LAYERS = 19, 38, 24
GB = 1e9


def _rss() -> int:
    """This process's peak resident set: VmHWM, which a new program starts afresh (ru_maxrss is kept across exec on
    Linux, so a child would report the parent's peak: the checkpoint it wrote)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_random(path: Path, specs: dict[str, tuple[int, ...]]) -> int:
    """One safetensors file of random bf16 tensors (written one tensor at a time, in name order)."""
    import torch

    from publisher.streaming import safetensors_io as stio

    spans, off = [], 0
    for k in sorted(specs):
        size = math.prod(specs[k]) * 2
        spans.append((k, "BF16", specs[k], off, off + size))
        off += size
    gen = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        f.write(stio.encode_header({"format": "pt"}, spans))
        for k in sorted(specs):
            f.write(stio.tensor_bytes(torch.randn(specs[k], generator=gen).mul_(0.02).to(torch.bfloat16)))
    return off


def build_llama(folder: Path, layers: int) -> int:
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    from publisher.testing.tiny import llama_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers})
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    config.save_pretrained(folder)
    llama_tokenizer(512).save_pretrained(folder)  # a small tokenizer: the ids it makes all lie in the vocabulary
    return write_random(folder / "model.safetensors", {k: tuple(v.shape) for k, v in model.state_dict().items()})


def child_lm_pass(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    from publisher import recipes
    from publisher.quality import lm
    from publisher.streaming import StreamJob, stream_quantize
    from publisher.verify.inpass import Together

    config = json.loads((Path(a["src"]) / "config.json").read_text())
    observer = None
    if a["perplexity"]:
        ids = torch.randint(3, 500, (max(1, a["tokens"] // 512), min(512, a["tokens"])), generator=torch.Generator().manual_seed(0))
        observer = lm.observer("transformers", "LlamaForCausalLM", config, ids, "bench")
    started = time.perf_counter()
    stream_quantize(StreamJob(Path(a["src"]), Path(a["dst"]), library="transformers", recipe=recipes.get("int8wo"),
                              class_name="LlamaForCausalLM"), observer=Together(observer) if observer else None)
    out = {"wall_s": time.perf_counter() - started, "peak_rss": _rss()}
    if observer is not None:
        got = observer.result()
        out.update(ppl_ok=got.output is not None, detail=got.detail, cpu_s=got.cpu_seconds,
                   ppl=[lm.perplexity(got.base_output), lm.perplexity(got.output)] if got.output is not None else None)
    return out


def child_lm_step(a: dict[str, Any]) -> dict[str, Any]:
    """One continuation step, and (``a["after"]``) the perplexity after the pass, block by block from the files."""
    import torch

    from publisher.quality import lm, sources

    config = json.loads((Path(a["src"]) / "config.json").read_text())
    out: dict[str, Any] = {"import_rss": _rss()}
    for role, folder in (("base", a["src"]), ("quantized", a["dst"])):
        weights = sources.saved(sources.local_shards(Path(folder)))  # type: ignore[arg-type]
        started = time.perf_counter()
        if a["after"]:
            ids = torch.randint(3, 500, (max(1, a["tokens"] // 512), min(512, a["tokens"])))
            lm.nll_after_pass(weights, "transformers", "LlamaForCausalLM", config, ids)
        else:
            lm.greedy(weights, "transformers", "LlamaForCausalLM", config, Path(a["src"]), list(lm.PROMPTS), 3)
        out[role] = (time.perf_counter() - started) / (1 if a["after"] else 3)  # greedy: prefill + 2 steps, each a read
    out["peak_rss"] = _rss()
    return out


def child_lm_publish(a: dict[str, Any]) -> dict[str, Any]:
    """What a publish of this base does, in one process as the CLI does it: the quantization pass (no in-pass perplexity
    at this vocabulary: quality/stage.py ``observer``), then the evaluation after it, block by block from the files
    with the embedding and head read row by row (verify/rowwise.py): the perplexity of both models on ``tokens`` tokens,
    then a 3-token greedy continuation of the three prompts. The peak RSS (VmHWM) after each part."""
    import torch

    from publisher import recipes
    from publisher.quality import lm, sources
    from publisher.streaming import StreamJob, stream_quantize
    from publisher.verify import streaming

    rows: list[str] = []
    attach = streaming.BlockLoader.attach

    def recording(self: Any) -> None:  # which blocks were read row by row
        attach(self)
        rows.extend(self.row_by_row)

    streaming.BlockLoader.attach = recording  # type: ignore[method-assign]
    config = json.loads((Path(a["src"]) / "config.json").read_text())
    out: dict[str, Any] = {"import_rss": _rss()}
    started = time.perf_counter()
    stream_quantize(StreamJob(Path(a["src"]), Path(a["dst"]), library="transformers", recipe=recipes.get("int8wo"),
                              class_name="LlamaForCausalLM"))
    out.update(pass_s=time.perf_counter() - started, pass_rss=_rss())
    ids = torch.randint(3, 500, (max(1, a["tokens"] // 512), min(512, a["tokens"])), generator=torch.Generator().manual_seed(0))
    weights = {role: sources.saved(sources.local_shards(Path(a[key])))  # type: ignore[arg-type]
               for role, key in (("base", "src"), ("quantized", "dst"))}
    started = time.perf_counter()
    nll = {role: lm.nll_after_pass(w, "transformers", "LlamaForCausalLM", config, ids) for role, w in weights.items()}
    out.update(ppl_s=time.perf_counter() - started, ppl_rss=_rss(), scored=int(ids.shape[0] * (ids.shape[1] - 1)),
               ppl=[lm.perplexity(nll["base"]), lm.perplexity(nll["quantized"])])
    started = time.perf_counter()
    for w in weights.values():
        lm.greedy(w, "transformers", "LlamaForCausalLM", config, Path(a["src"]), list(lm.PROMPTS), 3)
    out.update(step_s=(time.perf_counter() - started) / 3, eval_rss=_rss(), row_by_row=sorted(set(rows)))
    return out


def child_flux(a: dict[str, Any]) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKL
    from transformers import T5Config, T5EncoderModel

    from publisher.loadpath import forward
    from publisher.quality import grid
    from publisher.quality.sources import local_shards
    from publisher.streaming.shards import TensorReader, build_index
    from publisher.verify.streaming import BLOCK_BUDGET, BlockLoader, meta_model

    src = Path(a["src"])
    config = json.loads((src / "config.json").read_text())
    model = meta_model("diffusers", "FluxTransformer2DModel", config)
    source = local_shards(src)
    times: dict[str, float] = {}

    def timer(name: str) -> Any:
        def pre(mod: Any, args: Any) -> None:
            times[name + "_start"] = time.perf_counter()

        def post(mod: Any, args: Any, out: Any) -> None:
            times[name] = time.perf_counter() - times.pop(name + "_start")

        return pre, post

    for name, module in (("double", model.transformer_blocks[0]), ("single", model.single_transformer_blocks[0])):
        pre, post = timer(name)
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    call = {"hidden_states": torch.randn(1, 16, 64, dtype=torch.bfloat16),
            "encoder_hidden_states": torch.randn(1, 512, 4096, dtype=torch.bfloat16),
            "pooled_projections": torch.randn(1, 768, dtype=torch.bfloat16), "timestep": torch.tensor([1.0]),
            "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(512, 3), "guidance": torch.tensor([3.5])}
    with TensorReader(source, build_index(source)) as reader:  # type: ignore[arg-type]
        loader = BlockLoader(model, reader, BLOCK_BUDGET)
        loader.attach()
        started = time.perf_counter()
        forward(model, "diffusers", call)
        total = time.perf_counter() - started
    t5 = T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=1, num_heads=64,
                                 feed_forward_proj="gated-gelu")).to(torch.bfloat16).eval()
    with torch.inference_mode():
        started = time.perf_counter()
        t5(input_ids=torch.randint(0, 32000, (1, 512)))
        t5_layer = time.perf_counter() - started
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=2).to(torch.bfloat16).eval()
    with torch.inference_mode():
        started = time.perf_counter()
        vae.decode(torch.randn(1, 16, 8, 8, dtype=torch.bfloat16))
        vae_s = time.perf_counter() - started
    return {"call_s": total, "double_s": times["double"], "single_s": times["single"], "t5_layer_s": t5_layer,
            "vae_decode_s": vae_s, "flops": grid.measured_flops(), "peak_rss": _rss()}


def _child(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"kind": kind, **args}, f)
    proc = subprocess.run([sys.executable, __file__, "--child", f.name], capture_output=True, text=True)
    os.unlink(f.name)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_lm(work: Path, layers: int, tokens: int) -> None:
    src, dst = work / "llama", work / "llama-int8wo"
    size = build_llama(src, layers)
    print(f"Llama-3-8B-shaped base, {layers} layer(s): {size / GB:.2f} GB bf16; {tokens} tokens, windows of 512")
    alone = _child("lm_pass", {"src": str(src), "dst": str(dst), "perplexity": False, "tokens": tokens})
    ppl = _child("lm_pass", {"src": str(src), "dst": str(dst), "perplexity": True, "tokens": tokens})
    step = _child("lm_step", {"src": str(src), "dst": str(dst), "after": False})
    after = _child("lm_step", {"src": str(src), "dst": str(dst), "after": True, "tokens": tokens})
    publish = _child("lm_publish", {"src": str(src), "dst": str(dst), "tokens": tokens})
    added = ppl["wall_s"] - alone["wall_s"]
    print(f"  quantization pass alone: {alone['wall_s']:.1f} s, peak RSS {alone['peak_rss'] / 2**30:.2f} GiB")
    print(f"  with the perplexity pass riding along (not what a publish does at this vocabulary): {ppl['wall_s']:.1f} s "
          f"(+{added:.1f} s; its two forward threads used {ppl.get('cpu_s', 0):.1f} CPU s), peak RSS "
          f"{ppl['peak_rss'] / 2**30:.2f} GiB, ran: {ppl['ppl_ok']} ({ppl['detail']})")
    print(f"  one continuation step, 3 prompts, alone: base {step['base']:.1f} s, quantized {step['quantized']:.1f} s "
          f"(reads every weight once), peak RSS {step['peak_rss'] / 2**30:.2f} GiB (after imports "
          f"{step['import_rss'] / 2**30:.2f})")
    print(f"  perplexity after the pass, alone: base {after['base']:.1f} s, quantized {after['quantized']:.1f} s, peak RSS "
          f"{after['peak_rss'] / 2**30:.2f} GiB")
    print(f"  as a publish runs it, one process (pass, then perplexity and continuation after it; read row by row: "
          f"{', '.join(publish['row_by_row']) or 'nothing'}): pass {publish['pass_s']:.1f} s (peak RSS "
          f"{publish['pass_rss'] / 2**30:.2f} GiB), perplexity of both models on {publish['scored']} tokens "
          f"{publish['ppl_s']:.1f} s = {publish['ppl_s'] / max(publish['scored'], 1):.2f} s per token (peak RSS so far "
          f"{publish['ppl_rss'] / 2**30:.2f} GiB), one continuation step of both models {publish['step_s']:.1f} s; "
          f"peak RSS of the whole run **{publish['eval_rss'] / 2**30:.2f} GiB** (after imports "
          f"{publish['import_rss'] / 2**30:.2f})")
    # per layer: the difference a layer makes, the embedding and head counted once
    per_layer = LLAMA3_8B_LAYERS / layers
    fixed = 2 * LLAMA3_8B["vocab_size"] * LLAMA3_8B["hidden_size"] * 2  # embedding + head bytes
    share = (size - fixed) / size  # the part of the weights (and of the compute, about) that the layers hold
    project = lambda s: s * (share * per_layer + (1 - share))  # noqa: E731
    print(f"  projected to Llama-3-8B ({LLAMA3_8B_LAYERS} layers, by weight share): perplexity after the pass about "
          f"{project(publish['ppl_s']) / max(publish['scored'], 1):.1f} s per token for both models; a 16-token "
          f"continuation about {project(publish['step_s']) * 17 / 60:.0f} min; the in-pass perplexity would add about "
          f"{project(max(added, 0)) / 60:.0f} min for these {tokens} tokens")


def bench_flux(work: Path) -> None:
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    from publisher.quality import grid
    from publisher.quality.options import AUTO_CEILING_S
    from publisher.testing.configs import flux_dev_shaped

    src = work / "flux"
    src.mkdir(parents=True, exist_ok=True)
    with init_empty_weights():
        model = FluxTransformer2DModel.from_config(flux_dev_shaped(1, 1))
    model.save_config(src)
    size = write_random(src / "diffusion_pytorch_model.safetensors", {k: tuple(v.shape) for k, v in model.state_dict().items()})
    got = _child("flux", {"src": str(src)})
    call = got["call_s"] + (FLUX_DOUBLE - 1) * got["double_s"] + (FLUX_SINGLE - 1) * got["single_s"]
    image = 2 * call + T5_LAYERS * got["t5_layer_s"] + got["vae_decode_s"]
    print(f"FLUX.1-dev-shaped transformer, 1 double + 1 single block: {size / GB:.2f} GB bf16; at 64 px (528 tokens), "
          f"block by block from local files")
    print(f"  one call {got['call_s']:.1f} s (double block {got['double_s']:.1f} s, single {got['single_s']:.1f} s), "
          f"T5-XXL layer on 512 tokens {got['t5_layer_s']:.2f} s, VAE decode {got['vae_decode_s']:.2f} s; "
          f"peak RSS {got['peak_rss'] / 2**30:.2f} GiB; bf16 matmul {got['flops'] / 1e9:.0f} GFLOP/s")
    print(f"  projected to FLUX.1-dev: one denoiser call {call / 60:.1f} min, one 2-step 64 px image "
          f"{image / 60:.1f} min, the grid (6 images) {6 * image / 3600:.1f} h")
    least = grid.lower_bound(11_900_000_000, 23_800_000_000, 0.3 * GB, got["flops"])
    print(f"  the grid stage's lower bound of one step at 64 px (read rate 0.3 GB/s): {least:.0f} s; against the "
          f"auto budget at this size ({AUTO_CEILING_S:.0f} s) the stage gives up without running anything: "
          f"{least > 0.25 * AUTO_CEILING_S}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm", action="store_true")
    parser.add_argument("--flux", action="store_true")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        args = json.loads(Path(a.child).read_text())
        print(json.dumps(globals()[f"child_{args.pop('kind')}"](args)))
        return
    with tempfile.TemporaryDirectory(prefix="hf-ao-bench-quality-", dir=a.workdir) as work:
        if a.lm or not a.flux:
            bench_lm(Path(work), a.layers, a.tokens)
        if a.flux or not a.lm:
            bench_flux(Path(work))


if __name__ == "__main__":
    main()
