"""publisher/runtime/patches.py: a library's attributes replaced by the first holder, put back by the last one."""

from __future__ import annotations

import types

from publisher.runtime.patches import Patches


class Base:
    def inherited(self) -> str:
        return "base"


class Owner(Base):
    @classmethod
    def made(cls) -> str:
        return "library"


def test_installed_once_by_the_first_holder_kept_while_one_holds_them() -> None:
    module = types.ModuleType("library")
    module.flag = "library"  # type: ignore[attr-defined]
    patches = Patches()
    installs = []

    def install() -> dict[tuple[object, str], object]:
        installs.append(Owner.made())  # the library's own, still in place when install runs
        return {(module, "flag"): "ours", (Owner, "made"): classmethod(lambda cls: "ours")}

    outer = patches.held(install)
    outer.__enter__()
    with patches.held(install):  # a second holder (nested, or another thread's): the same, not installed again
        assert (module.flag, Owner.made()) == ("ours", "ours")  # type: ignore[attr-defined]
    assert (module.flag, Owner.made()) == ("ours", "ours")  # type: ignore[attr-defined]  # one holder left
    outer.__exit__(None, None, None)
    assert installs == ["library"] and (module.flag, Owner.made()) == ("library", "library")  # type: ignore[attr-defined]


def test_the_last_holder_restores_the_descriptor_and_deletes_what_was_inherited() -> None:
    module = types.ModuleType("library")
    module.flag = "library"  # type: ignore[attr-defined]
    saved = Owner.__dict__["made"]
    patches = Patches()
    with patches.held(lambda: {(module, "flag"): "ours", (Owner, "made"): classmethod(lambda cls: "ours"),
                               (Owner, "inherited"): lambda self: "ours"}):
        pass
    assert module.flag == "library" and Owner.__dict__["made"] is saved  # type: ignore[attr-defined]
    assert "inherited" not in Owner.__dict__ and Owner().inherited() == "base"
