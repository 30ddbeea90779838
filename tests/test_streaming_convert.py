"""The streaming engine against the documented library path, on tiny models built here.

Both paths run in this process on the same checkpoint; the outputs must be the same files: equal tensor
bytes, equal parsed safetensors headers (metadata included; safetensors itself writes the metadata keys
in hash order, so header *bytes* differ between two library runs too), equal index and config files,
and reloaded models that give bit-identical outputs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from publisher import recipes
from publisher.errors import QuantizeError

# Recipes a CPU can quantize: natively, or (FP8 dynamic) through publisher.fp8cpu's bypass, which both
# paths then run inside.
CPU_RECIPES = [r for r in recipes.all_recipes() if not r.needs_gpu_to_quantize]  # made on a CPU
pytestmark = pytest.mark.slow


# ---------------------------------------------------------------- tiny checkpoints

@pytest.fixture(scope="module")
def flux_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from publisher.testing.configs import FLUX_TINY_SHARDED, flux_transformer

    model = flux_transformer(FLUX_TINY_SHARDED, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("flux") / "transformer"
    model.save_pretrained(path, max_shard_size="200KB")
    assert len(list(path.glob("*.safetensors"))) >= 3, "the tiny transformer should be sharded"
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def llama_src(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=request.param)
    # float32 on disk: the bf16 cast is part of what must match
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("llama") / "model"
    model.save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    return path


# ---------------------------------------------------------------- comparison helpers

def _header(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def assert_same_output(lib: Path, streamed: Path) -> None:
    names = sorted(p.name for p in lib.iterdir())
    assert names == sorted(p.name for p in streamed.iterdir())
    for name in names:
        a, b = lib / name, streamed / name
        if name.endswith(".safetensors"):
            na, ha, da = _header(a)
            nb, hb, db = _header(b)
            assert ha == hb, f"{name}: parsed headers differ"
            assert list(ha) == list(hb), f"{name}: tensor order differs"
            assert na == nb and len(da) == len(db)
            assert da == db, f"{name}: tensor bytes differ"
        else:
            assert a.read_bytes() == b.read_bytes(), f"{name} differs"


def _flux_out(path: Path) -> object:
    import torch
    from diffusers import FluxTransformer2DModel

    from publisher.testing.configs import FLUX_TINY_SHARDED as cfg

    model = FluxTransformer2DModel.from_pretrained(path, torch_dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    seq, txt = 16, 8
    inputs = dict(
        hidden_states=torch.randn(1, seq, cfg["in_channels"], generator=g, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, txt, cfg["joint_attention_dim"], generator=g, dtype=torch.bfloat16),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=g, dtype=torch.bfloat16),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        guidance=torch.tensor([3.5], dtype=torch.bfloat16),
        img_ids=torch.zeros(seq, 3), txt_ids=torch.zeros(txt, 3),
    )
    with torch.no_grad():
        return model(**inputs).sample


def _llama_out(path: Path) -> object:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.arange(12).reshape(1, 12)).logits


def _run_both(src: Path, tmp: Path, library: str, recipe: recipes.Recipe, **kw: object):
    from publisher.streaming import StreamJob, stream_quantize
    from publisher.testing.reference import library_quantize

    exclude = kw.pop("exclude", ())
    model = library_quantize(src, tmp / "lib", library=library, recipe=recipe, exclude=exclude, **kw)
    result = stream_quantize(StreamJob(src, tmp / "stream", library=library, recipe=recipe, exclude=exclude,  # type: ignore[arg-type]
                                       progress=False, **kw))
    return model, result


def _linear_names(model: object) -> tuple[list[str], list[str]]:
    import torch
    from torchao.utils import TorchAOBaseTensor

    q, plain = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            (q if isinstance(mod.weight, TorchAOBaseTensor) else plain).append(name)
    return q, plain


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("recipe", CPU_RECIPES, ids=lambda r: r.name)
def test_diffusers_bit_identical(flux_src: Path, tmp_path: Path, recipe: recipes.Recipe) -> None:
    import torch

    # group size 32 (the CPU int4 recipes) does not divide x_embedder's 16 or context_embedder's 48 in_features
    exclude = ["context_embedder", "x_embedder"] if recipe.tensor_class == "IntxUnpackedToInt8Tensor" else []
    model, result = _run_both(flux_src, tmp_path, "diffusers", recipe, max_shard_size="100KB", exclude=exclude)
    assert_same_output(tmp_path / "lib", tmp_path / "stream")
    assert (tmp_path / "stream" / "diffusion_pytorch_model.safetensors.index.json").exists()
    quantized, plain = _linear_names(model)
    assert result.quantized == quantized and result.skipped == [] and sorted(result.excluded) == sorted(plain) == exclude
    assert torch.equal(_flux_out(tmp_path / "lib"), _flux_out(tmp_path / "stream"))


@pytest.mark.parametrize("name", ["float8wo", "float8dq", "float8dq-tensor"])
def test_float8_row_blocks_bit_identical(flux_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         name: str) -> None:
    """The engine quantizes large float8 weights a block of rows at a time (streaming/fp8blocks.py); with blocks of a
    few rows every tiny weight here takes that path (rows not a multiple of the block included), and the output is
    still the library path's (torchao's own from_hp), byte for byte."""
    from publisher.streaming import fp8blocks

    monkeypatch.setattr(fp8blocks, "ROW_BLOCK_BYTES", 3 * 64 * 4)  # 3 rows of 64 float32
    taken: list[tuple[int, ...]] = []
    real = fp8blocks.in_row_blocks

    def spy(hp_tensor: object, **kwargs: object) -> object:
        made = real(hp_tensor, **kwargs)  # type: ignore[arg-type]
        if made is not None:
            taken.append(tuple(hp_tensor.shape))  # type: ignore[attr-defined]
        return made

    monkeypatch.setattr(fp8blocks, "in_row_blocks", spy)
    _, result = _run_both(flux_src, tmp_path, "diffusers", recipes.get(name), max_shard_size="100KB")
    assert_same_output(tmp_path / "lib", tmp_path / "stream")
    assert len(taken) == len(result.quantized) and any(rows % fp8blocks.rows_per_block(cols) for rows, cols in taken)


@pytest.mark.parametrize("recipe", CPU_RECIPES, ids=lambda r: r.name)
def test_transformers_bit_identical(llama_src: Path, tmp_path: Path, recipe: recipes.Recipe) -> None:
    import torch

    model, result = _run_both(llama_src, tmp_path, "transformers", recipe, max_shard_size="20KB")
    assert_same_output(tmp_path / "lib", tmp_path / "stream")
    quantized, plain = _linear_names(model)
    assert result.quantized == quantized and len(quantized) == 14
    assert result.excluded == plain == ["lm_head"]  # transformers' default skip
    assert torch.equal(_llama_out(tmp_path / "lib"), _llama_out(tmp_path / "stream"))


@pytest.mark.parametrize("kind", ["t5", "clip"])
def test_flux_text_encoders(kind: str, tmp_path: Path) -> None:
    """FLUX's text encoders: T5 (keep-in-fp32 'wo', which transformers' name matching does not exclude) and CLIP."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    if kind == "t5":
        model = T5EncoderModel(T5Config(vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4))
    else:
        model = CLIPTextModel(CLIPTextConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    model.save_pretrained(tmp_path / "src", max_shard_size="50KB")
    from publisher.streaming import supports

    assert supports("transformers", tmp_path / "src", recipes.get("int8wo")) is None
    lib_model, result = _run_both(tmp_path / "src", tmp_path, "transformers", recipes.get("int8wo"), max_shard_size="20KB")
    assert_same_output(tmp_path / "lib", tmp_path / "stream")
    assert result.quantized == _linear_names(lib_model)[0]


def test_per_layer_tables_stream_bit_identical(flux_src: Path, tmp_path: Path) -> None:
    """An FqnToConfig (the --layer-config form): one config per layer, same-shaped layers with different configs, a null
    entry, and a config whose algorithm reads values (HQQ: no meta-device probe) -- streamed as the library makes it."""
    from torchao.quantization import FqnToConfig

    from publisher import recipe_args

    table = {"re:single_transformer_blocks\\..*": "float8wo", "proj_out": None,
             "re:transformer_blocks\\.0\\.attn\\..*": "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity="
             "PerGroup(32), intx_choose_qparams_algorithm=IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY)"}
    import json

    recipe = recipe_args.with_components(recipe_args.parse(["int8wo"], [json.dumps(table)])[0], [""])
    assert isinstance(recipe.config_for(""), FqnToConfig)
    model, result = _run_both(flux_src, tmp_path, "diffusers", recipe, max_shard_size="100KB")
    assert_same_output(tmp_path / "lib", tmp_path / "stream")
    classes = {n: type(m.weight).__name__ for n, m in model.named_modules() if n in result.classes or n == "proj_out"}
    assert classes.pop("proj_out") == "Parameter" and "proj_out" in result.skipped + result.excluded
    assert result.classes == classes and set(classes.values()) == {"Int8Tensor", "Float8Tensor", "IntxUnpackedToInt8Tensor"}


def test_default_shard_size_single_file(flux_src: Path, tmp_path: Path) -> None:
    _run_both(flux_src, tmp_path, "diffusers", recipes.get("int8wo"))
    assert_same_output(tmp_path / "lib", tmp_path / "stream")
    assert sorted(p.name for p in (tmp_path / "stream").iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]


def test_exclude(flux_src: Path, llama_src: Path, tmp_path: Path) -> None:
    import torch

    recipe = recipes.get("int8wo")
    # diffusers matches by substring: "proj_out" also catches single_transformer_blocks.N.proj_out
    model, result = _run_both(flux_src, tmp_path / "d", "diffusers", recipe, exclude=["proj_out", "x_embedder"],
                              max_shard_size="100KB")
    assert_same_output(tmp_path / "d" / "lib", tmp_path / "d" / "stream")
    _, plain = _linear_names(model)
    assert result.excluded == plain
    assert set(plain) == {"x_embedder", "proj_out", "single_transformer_blocks.0.proj_out",
                          "single_transformer_blocks.1.proj_out"}
    assert torch.equal(_flux_out(tmp_path / "d" / "lib"), _flux_out(tmp_path / "d" / "stream"))
    # transformers matches patterns against parameter names ("...down_proj.weight"): a bare "down_proj"
    # excludes nothing, a module prefix or a regex does. It also drops its default skips once a list is
    # given, so lm_head gets quantized unless it is tied to the embedding.
    model, result = _run_both(llama_src, tmp_path / "t", "transformers", recipe,
                              exclude=["down_proj", "model.layers.1.mlp.up_proj", r".*\.0\.self_attn\.o_proj"])
    assert_same_output(tmp_path / "t" / "lib", tmp_path / "t" / "stream")
    quantized, plain = _linear_names(model)
    assert result.quantized == quantized and result.excluded == plain
    tied = json.loads((llama_src / "config.json").read_text())["tie_word_embeddings"]
    assert plain == ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.up_proj"] + (["lm_head"] if tied else [])


def test_skipped_shapes_are_reported(flux_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler that leaves some shapes alone (as float8/int4 handlers do on GPUs) is mirrored and reported."""
    from torchao.quantization import Int8WeightOnlyConfig
    from torchao.quantization.quant_api import _QUANTIZE_CONFIG_HANDLER

    real = _QUANTIZE_CONFIG_HANDLER[Int8WeightOnlyConfig]

    def picky(module, config, **kw):  # type: ignore[no-untyped-def]
        return module if module.weight.shape[0] % 3 == 0 else real(module, config, **kw)

    monkeypatch.setitem(_QUANTIZE_CONFIG_HANDLER, Int8WeightOnlyConfig, picky)
    model, result = _run_both(flux_src, tmp_path, "diffusers", recipes.get("int8wo"), max_shard_size="100KB")
    assert_same_output(tmp_path / "lib", tmp_path / "stream")
    _, plain = _linear_names(model)
    assert plain and result.skipped == plain and result.excluded == []


def test_callbacks_order(flux_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from publisher.streaming import StreamJob, feed, stream_quantize
    from publisher.streaming.safetensors_io import read_header

    local = tmp_path / "local"  # config + index only; shards arrive through the job's inputs
    local.mkdir()
    for name in ("config.json", "diffusion_pytorch_model.safetensors.index.json"):
        shutil.copy(flux_src / name, local / name)
    cache = tmp_path / "cache"
    cache.mkdir()
    events: list[tuple[str, str]] = []

    class Downloads:  # streaming.ShardInputs: each shard "downloaded" when due, deleted once read
        def open(self, name: str) -> Path:
            assert not any(cache.iterdir()), "a previous input shard was not released before the next fetch"
            events.append(("fetch", name))
            return Path(shutil.copy(flux_src / name, cache / name))

        def release(self, path: Path) -> None:
            events.append(("release", path.name))
            path.unlink()

    class Watch:  # streaming.OutputSink
        def planned(self, files: dict[str, set[str]], digests: object) -> None:
            events.append(("planned", ""))

        def reserve(self, path: Path, nbytes: int) -> None:
            pass

        def written(self, path: Path) -> None:
            events.append(("output", path.name))
            if path.suffix == ".safetensors":  # complete: header parses and the data ends where it says
                _, entries = read_header(path)
                assert path.stat().st_size == max(e.end for e in entries.values())

    # One tensor read ahead at a time, as on a model whose tensors are larger than the read-ahead budget (this
    # one's all fit in it, and would all be read before the first output shard is complete).
    monkeypatch.setattr(feed, "AHEAD_BYTES", 1)
    stream_quantize(StreamJob(local, tmp_path / "out", library="diffusers", recipe=recipes.get("int8wo"),
                              inputs=Downloads(), progress=False, max_shard_size="100KB"), sink=Watch())
    assert events[0] == ("planned", "")  # the layout before any shard is read
    inputs = sorted(json.loads((local / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"].values())
    fetched = [n for kind, n in events if kind == "fetch"]
    assert fetched == sorted(set(inputs))
    for name in fetched:  # each released once, right after its own tensors and before the next fetch
        i = events.index(("fetch", name))
        assert [e for e in events[i + 1:] if e[0] != "output"][0] == ("release", name)
    outputs = [n for kind, n in events if kind == "output"]
    assert outputs[0] == "config.json" and outputs[-1] == "diffusion_pytorch_model.safetensors.index.json"
    assert sorted(outputs) == sorted(p.name for p in (tmp_path / "out").iterdir())
    # outputs are reported while inputs are still being read, not all at the end
    first_output_shard = next(i for i, e in enumerate(events) if e[0] == "output" and e[1].endswith(".safetensors"))
    assert first_output_shard < events.index(("release", fetched[-1]))
    # Same files as the library path run on the full folder, but for the source path config.json records.
    from publisher.testing.reference import library_quantize

    library_quantize(flux_src, tmp_path / "lib", library="diffusers", recipe=recipes.get("int8wo"), max_shard_size="100KB")
    lib_config = json.loads((tmp_path / "lib" / "config.json").read_text())
    assert lib_config.pop("_name_or_path") == str(flux_src)
    (tmp_path / "lib" / "config.json").write_text(json.dumps({**lib_config, "_name_or_path": str(local)}, indent=2, sort_keys=True) + "\n")
    assert_same_output(tmp_path / "lib", tmp_path / "out")


def test_supports_reasons(flux_src: Path, tmp_path: Path) -> None:
    import torch

    from publisher.streaming import StreamJob, stream_quantize, supports

    assert supports("diffusers", flux_src, recipes.get("int8wo")) is None
    assert "config.json" in supports("diffusers", tmp_path, recipes.get("int8wo"))
    assert "onnx" in supports("onnx", flux_src, recipes.get("int8wo"))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((flux_src / "config.json").read_text())
    assert "pickle" in supports("diffusers", pickled, recipes.get("int8wo"))
    assert supports("diffusers", pickled, recipes.get("int8wo"), remote_files=["diffusion_pytorch_model.safetensors"]) is None
    if not torch.cuda.is_available():
        gpu_only = [r for r in recipes.all_recipes() if r not in CPU_RECIPES]
        for recipe in gpu_only:
            reason = supports("diffusers", flux_src, recipe)
            assert reason and "CUDA" in reason
        with pytest.raises(QuantizeError, match="library path"):
            stream_quantize(StreamJob(flux_src, tmp_path / "x", library="diffusers", recipe=gpu_only[0]))
        assert "no CUDA GPU" in supports("diffusers", flux_src, recipes.get("int8wo"), device="cuda")
