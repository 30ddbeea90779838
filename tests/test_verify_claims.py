"""publisher/verify/claims.py: the card's version claims come only from measured loads."""

from __future__ import annotations

from publisher.handoffs.report import EnvRecord, PathResult, VerifyReport
from publisher.verify import claims

HERE = {"torch": "2.13.0+cpu", "torchao": "0.18.0", "diffusers": "0.42.1", "transformers": "5.23.0", "safetensors": "0.8.0"}


def _result(env: str, path: str, outcome: str, **versions: str) -> PathResult:
    r = PathResult("transformer", path, env, {**HERE, **versions}, ok=outcome == "pass", quantized_layers=30,
                   forward_checked=outcome == "pass")
    r.silent = outcome == "silently wrong"
    r.detail = {"pass": "", "fail": "ValueError: boom", "silently wrong": "loads without an error, but 0 of 30 planned layers are Int8Tensor"}[outcome]
    return r


def _report(matrix: dict[str, tuple[str, str, dict[str, str]]]) -> VerifyReport:
    """spec -> (library outcome, manual outcome, versions the spec changes)"""
    report = VerifyReport("int8wo", "x", True, tensor_class="Int8Tensor")
    report.results = [_result("current", "library", "pass"), _result("current", "manual", "pass")]
    report.environments = [EnvRecord("current", "current", gating=True)]
    for spec, (lib, man, versions) in matrix.items():
        report.environments.append(EnvRecord(spec, "spec", gating=False, packages={k: v for k, v in versions.items()}))
        report.compat += [_result(spec, "library", lib, **versions), _result(spec, "manual", man, **versions)]
    return report


def _claims(comp: claims.Compatibility, path: str) -> dict[str, claims.Claim]:
    return {c.package: c for c in comp.claims[path]}


def test_minimums_only_where_a_load_passed() -> None:
    comp = claims.summarise(_report({
        "torchao==0.17.0": ("fail", "fail", {"torchao": "0.17.0"}),
        "diffusers==0.39.0": ("pass", "pass", {"diffusers": "0.39.0"}),
        "diffusers==0.38.0": ("silently wrong", "pass", {"diffusers": "0.38.0", "huggingface-hub": "1.33.0"}),
    }), {"diffusers"})
    assert comp.packages == ["torch", "torchao", "diffusers", "safetensors"]  # transformers: no component loads with it
    lib, man = _claims(comp, "library"), _claims(comp, "manual")
    assert lib["diffusers"].minimum == "0.39.0" and man["diffusers"].minimum == "0.38.0"
    assert lib["diffusers"].text() == ("diffusers >= 0.39.0 (measured: 0.39.0 and 0.42.1 pass; 0.38.0 silently wrong; "
                                       "versions in between not measured)")
    assert lib["torchao"].minimum == "0.18.0" and lib["torchao"].not_passed == [("0.17.0", "fail")]
    assert lib["torch"].text() == "torch 2.13.0+cpu (the only version measured)"  # no old torch run: no torch claim
    assert comp.counts == {"pass": 5, "fail": 2, "silently wrong": 1}
    assert [r.env.name for r in comp.silently_wrong] == ["diffusers==0.38.0"]
    assert [r.env.name for r in comp.manual_rescues] == ["diffusers==0.38.0"]
    warning = claims.warnings(comp)
    assert warning == ["with diffusers 0.38.0, transformer loaded through the library loaders raises no error, "
                       "but 0 of 30 planned layers are Int8Tensor"]
    text = claims.manual_text(comp)
    assert "including" not in text and "diffusers 0.38.0" in text.split("do not load it correctly: ")[1]
    assert "It does not work with: torchao 0.17.0 (fail)" in text
    assert text.startswith("Measured to load this repo correctly with: this tool's own environment (torch 2.13.0+cpu, "
                           "torchao 0.18.0, diffusers 0.42.1); diffusers 0.39.0; diffusers 0.38.0.")


def test_a_failure_between_breaks_the_minimum() -> None:
    comp = claims.summarise(_report({
        "diffusers==0.39.0": ("pass", "pass", {"diffusers": "0.39.0"}),
        "diffusers==0.40.0": ("fail", "pass", {"diffusers": "0.40.0"}),
    }), {"diffusers"})
    assert _claims(comp, "library")["diffusers"].minimum == "0.42.1"  # 0.39.0 passed, but 0.40.0 above it failed
    assert _claims(comp, "manual")["diffusers"].minimum == "0.39.0"


def test_a_newer_release_that_fails_bounds_the_claim_from_above() -> None:
    """Forward in time (issue 39): the newest transformers on the index fails, an older newer one passes."""
    comp = claims.summarise(_report({
        "transformers==5.0.0": ("pass", "pass", {"transformers": "5.0.0"}),
        "transformers==5.25.0": ("fail", "pass", {"transformers": "5.25.0"}),
        "torch==2.15.0": ("pass", "pass", {"torch": "2.15.0+cpu"}),
    }), {"transformers"})
    lib, man = _claims(comp, "library"), _claims(comp, "manual")
    assert lib["transformers"].text() == ("transformers >= 5.0.0, < 5.25.0 (measured: 5.0.0 and 5.23.0 pass; 5.25.0 fail; "
                                          "versions in between not measured)")
    assert man["transformers"].ceiling is None and "<" not in man["transformers"].text()
    assert lib["torch"].text() == ("torch >= 2.13.0+cpu (measured: 2.13.0+cpu and 2.15.0+cpu pass; versions in between "
                                   "not measured)")


def test_environments_naming_several_packages_are_shown_but_claim_nothing() -> None:
    comp = claims.summarise(_report({
        "diffusers==0.39.0,torchao==0.17.0": ("pass", "pass", {"diffusers": "0.39.0", "torchao": "0.17.0"}),
    }), {"diffusers"})
    assert _claims(comp, "library")["diffusers"].minimum == "0.42.1"
    assert len(comp.rows) == 2 and comp.rows[1].env.name == "diffusers==0.39.0,torchao==0.17.0"


def test_table_cells() -> None:
    comp = claims.summarise(_report({"diffusers==0.38.0": ("silently wrong", "pass", {"diffusers": "0.38.0", "huggingface-hub": "1.33.0"})}),
                            {"diffusers"})
    rows = claims.table(comp)
    assert rows[0] == {"env": "this tool's own (made and verified here)", "component": "transformer",
                       "versions": "torch 2.13.0+cpu, torchao 0.18.0, diffusers 0.42.1, safetensors 0.8.0",
                       "library": "pass (bit-identical)", "manual": "pass (bit-identical)"}
    assert rows[1]["env"] == "this one with `diffusers==0.38.0`"
    assert rows[1]["versions"] == "torch 2.13.0+cpu, torchao 0.18.0, diffusers 0.38.0, safetensors 0.8.0 (with huggingface-hub 1.33.0)"
    assert rows[1]["library"].startswith("**SILENTLY WRONG**: loads without an error")
    long = _result("x", "library", "fail")
    long.detail = "a|b " * 200
    assert claims.cell(long).startswith("fail: a\\|b") and len(claims.cell(long)) < 260


def test_nothing_measured_claims_nothing() -> None:
    report = _report({})
    report.compat_note = "--compat none"
    comp = claims.summarise(report, {"diffusers"})
    assert comp.note == report.compat_note
    assert all(c.minimum == c.current and c.text().endswith("(the only version measured)") for c in comp.claims["library"])


def test_a_failed_load_is_one_plain_line_without_the_library_boilerplate() -> None:
    """The library's pointers to a report the card does not carry are left out; what raised and its first sentence that
    says something stay."""
    conversion = _result("x", "library", "fail")
    conversion.detail = ("RuntimeError: We encountered some issues during automatic conversion of the weights. For details "
                         "look at the `CONVERSION` entries of the above report!")
    assert claims.cell(conversion) == "fail: RuntimeError: We encountered some issues during automatic conversion of the weights"
    mismatch = _result("x", "manual", "fail")
    mismatch.detail = ("it loaded, but 3 of 5 planned layers are of the class their config implies; then it raised "
                       "RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an error. For details look "
                       "at the above report!\n\tYou may consider adding `ignore_mismatched_sizes=True`.")
    assert claims.cell(mismatch) == ("fail: it loaded, but 3 of 5 planned layers are of the class their config implies; then "
                                     "it raised RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an "
                                     "error")
    plain = _result("x", "library", "fail")
    plain.detail = "ValueError: boom"
    assert claims.cell(plain) == "fail: ValueError: boom"
    silent = _result("x", "library", "silently wrong")
    assert claims.cell(silent) == "**SILENTLY WRONG**: loads without an error, but 0 of 30 planned layers are Int8Tensor"
