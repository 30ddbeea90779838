"""Test infrastructure for the quality evaluation (publisher/quality/): a small text dataset laid out as the Hub stores
datasets (parquet shards per config and split, a card whose ``configs:`` list names them), a tiny Llama trained on
that text for a few seconds (a random one has the perplexity of a uniform guess, so no figure could tell a good
quantization from a broken one), and a deliberately damaged quantization: torchao's int8 tensors with their scales
zeroed, as a test-only hook around torchao's own constructor. Product code never imports this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DATASET_REPO = "Salesforce/wikitext"  # the default --eval-dataset's repo, config and split, so the default works here
DATASET_CONFIG = "wikitext-2-raw-v1"

SENTENCES = (
    " the cat sat on the red photo of a dog .",
    " a dog is in the photo and the cat is on the red dog .",
    " hello world , the photo of the cat is red and the dog sat .",
)


def text_rows(repeat: int = 60) -> list[str]:
    """wikitext's shape: headings, blank rows and sentences, one per row."""
    rows: list[str] = []
    for i in range(repeat):
        rows += ["", f" = Section {i} = \n", *(s + "\n" for s in SENTENCES)]
    return rows


def build_text_dataset(path: Path | str, rows: list[str] | None = None) -> Path:
    """``<config>/test-00000-of-00001.parquet`` (and a train split) with a ``text`` column, plus the README.md whose
    YAML ``configs`` the datasets library reads to find them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(path)
    folder = root / DATASET_CONFIG
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": rows or text_rows()}), folder / "test-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": text_rows(5)}), folder / "train-00000-of-00001.parquet")
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        f"- config_name: {DATASET_CONFIG}\n  data_files:\n"
        f"  - split: test\n    path: {DATASET_CONFIG}/test-*\n"
        f"  - split: train\n    path: {DATASET_CONFIG}/train-*\n"
        "---\n\n# wikitext (test fixture)\n\nA few sentences in wikitext-2-raw's layout, for offline tests.\n")
    return root


def build_trained_llama(path: Path | str, steps: int = 60, seed: int = 0) -> Path:
    """The tiny Llama of ``tiny.build_tiny_llama``, trained on ``SENTENCES`` (a few seconds on a CPU) so that its
    perplexity on the fixture dataset is low and a damaged quantization shows."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from publisher.testing.tiny import build_tiny_llama, seeded

    root = build_tiny_llama(path, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(root)
    ids = tokenizer("\n\n".join(text_rows(8)), return_tensors="pt", add_special_tokens=False, verbose=False)["input_ids"][0]
    windows = ids[: (len(ids) // 128) * 128].reshape(-1, 128)
    model = LlamaForCausalLM.from_pretrained(root, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with seeded(seed):
        for _ in range(steps):
            batch = windows[torch.randint(len(windows), (2,))]
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.to(torch.bfloat16).eval().save_pretrained(root)
    return root


@contextmanager
def zeroed_scales() -> Iterator[None]:
    """Every int8 tensor torchao makes in this process has its scales zeroed: a damaged quantization that saves,
    reloads and verifies bit for bit like a good one (the damage is in the bytes), so only a quality figure shows it."""
    from torchao.quantization import Int8Tensor

    original = Int8Tensor.__dict__["from_hp"]

    def damaged(cls: Any, *args: Any, **kwargs: Any) -> Any:
        tensor = original.__func__(cls, *args, **kwargs)
        tensor.scale.zero_()
        return tensor

    Int8Tensor.from_hp = classmethod(damaged)
    try:
        yield
    finally:
        Int8Tensor.from_hp = original


def place_lpips_trunk(torch_home: Path, seed: int = 0) -> Path:
    """An AlexNet trunk where LPIPS looks for torchvision's (``$TORCH_HOME/hub/checkpoints/alexnet-owt-7be5be79.pth``):
    random convolutions of AlexNet's shapes (``features.*`` only: 10 MB, where torchvision's file is 233 MB with its
    classifier), seeded. The tests cannot download the real one; with it, LPIPS is computed and named."""
    import torch

    from publisher.quality import perceptual

    generator = torch.Generator().manual_seed(seed)
    state = {}
    for index, cin, cout, kernel, _, _, _ in perceptual.CONVS:
        fan_in = cin * kernel * kernel
        state[f"features.{index}.weight"] = torch.randn(cout, cin, kernel, kernel, generator=generator) / fan_in**0.5
        state[f"features.{index}.bias"] = torch.randn(cout, generator=generator) * 0.01
    path = torch_home / "hub" / "checkpoints" / perceptual.TRUNK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path
