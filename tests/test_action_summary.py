"""action/summary.py: the job summary's tables, escaping, card preview and the 1 MiB budget."""

from __future__ import annotations

from action_harness import sample_result

from action.summary import (
    SUMMARY_BUDGET,
    SUMMARY_LIMIT,
    build_summary,
    cell,
    link,
    truncate_utf8,
)


def test_summary_tables_and_card_truncation() -> None:
    card = "---\nlicense: other\n---\n# Card\n```python\nprint(1)\n```\n" + "word " * 400_000  # ~2 MB
    text = build_summary("m", sample_result(), None, 0, {0: card}, ["tok_secret"])
    size = len(text.encode("utf-8"))
    assert size <= SUMMARY_BUDGET < SUMMARY_LIMIT
    assert "[alice/m-int8wo](http://hub/alice/m-int8wo)" in text
    assert "| `README.md` | 3.9 KiB |" in text and "3.0 GiB" in text
    assert "a&#124;b&lt;script&gt;.json" in text  # no raw pipe or HTML from a file name
    assert "| transformer | library | current | ✅ bit-identical | 0.0 | 12 |" in text
    assert "0.012300" in text and "0.999900" in text
    assert "````markdown" in text  # a fence longer than the card's own ``` blocks
    assert "Card truncated" in text and "the full card is at [http://hub/alice/m-int8wo]" in text
    small = build_summary("m", sample_result(), None, 0, {0: "# tiny card tok_secret\n"}, ["tok_secret"])
    assert "Card truncated" not in small and "tok_secret" not in small and "# tiny card ***" in small


def test_compatibility_matrix_table() -> None:
    result = sample_result()
    result["verification"]["compat"] = [
        {"component": "transformer", "path": "library", "env": "diffusers==0.38.0", "outcome": "silently wrong",
         "quantized_layers": 0, "detail": "loads without an error, but 0 of 12 planned layers are Int8Tensor"},
        {"component": "transformer", "path": "manual", "env": "diffusers==0.38.0", "outcome": "pass", "quantized_layers": 12,
         "detail": ""}]
    text = build_summary("m", result, None, 0, {}, [])
    assert "#### Compatibility (measured; does not decide the publish)" in text
    assert ("| transformer | library | diffusers==0.38.0 | ⚠️ **silently wrong** | 0 | loads without an error, but 0 of 12 "
            "planned layers are Int8Tensor |") in text
    assert "| transformer | manual | diffusers==0.38.0 | ✅ pass | 12 |  |" in text
    assert "Compatibility" not in build_summary("m", sample_result(), None, 0, {}, [])


def test_several_recipes_share_the_card_budget() -> None:
    results = {"results": [sample_result(), sample_result(repo_id="alice/m-int8dq", recipe="int8dq", commit="b" * 40,
                                              url="http://hub/alice/m-int8dq", up_to_date=True)], "verified": True}
    text = build_summary("m", results, None, 0, {0: "# a\n", 1: "# b\n"}, [])
    assert text.count("<details>") == 2 and "| int8dq | [alice/m-int8dq](http://hub/alice/m-int8dq) | ✅ up to date" in text
    big = build_summary("m", results, None, 0, {0: "x" * 2_000_000, 1: "y" * 2_000_000}, [])
    assert len(big.encode("utf-8")) <= SUMMARY_BUDGET and big.count("Card truncated") == 2


def test_failure_without_a_result() -> None:
    text = build_summary("x/y`|<b>", None, "boom tok_s | <i>", 2, {}, ["tok_s"])
    assert text.startswith("## ❌ hf-ao-publish: `x/y`&#124;&lt;b&gt;`")
    assert "> **Error:** boom *** &#124; &lt;i&gt;" in text and "tok_s" not in text


def test_cells_links_and_truncation() -> None:
    assert cell("a\nb | <c>") == "a b &#124; &lt;c&gt;" and cell(None) == ""
    assert link("x", "javascript:alert(1)") == "x" and link("x", "http://a b") == "x"
    assert link("x", "https://hub/x") == "[x](https://hub/x)"
    assert truncate_utf8("é" * 10, 5) == "éé"  # never half a character
    assert truncate_utf8("a" * 14 + "\nbbbbbb", 18) == "a" * 14 + "\n"  # at a line end in the last quarter
    assert truncate_utf8("line one\nline two", 16) == "line one\nline tw"  # not at one further back
