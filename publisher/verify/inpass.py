"""The forward checks of verification, run during the quantization pass while the weights are in memory.

Before this, a streamed component's forward check (the quantized weights, block by block) and its quality figure
(the bf16 base, block by block) each read every weight again after the pass: twice the base over the network with
``--low-disk``. Here the streaming engine hands every tensor, as soon as it is quantized, to this observer
(``streaming.job.TensorObserver``), which runs two forward passes at once, one per thread, on meta-device models:

- the **quantized** model gets the quantized tensors (the ones whose digests the engine records and the saved
  files must reproduce), and its output is the reference every reload is compared with, bit for bit;
- the **base** model gets the same tensors before quantization (bf16, as ``from_pretrained`` loads them): its
  output gives the quality figures.

Blocks are the smallest modules that hold weights (each Linear, norm, embedding), loaded just before they run
(``load_state_dict(assign=True)``, the manual load path) and dropped right after, so the forward passes hold about
one tensor more than the engine does. The engine reads tensors in the order the forward uses them: the order is
learnt beforehand from a forward pass on the meta device (no data). Should the real pass differ from it, or fall
behind by more than ``MAILBOX_LIMIT`` bytes, the observer gives up and says why; the verification then runs the
forward after the pass, as before (reading the weights again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from publisher.handoffs.report import PassForward
from publisher.loadpath import forward, to_meta
from publisher.verify.streaming import blocks, meta_model, own_state

if TYPE_CHECKING:
    from publisher.streaming.streamjob import TensorObserver

log = logging.getLogger(__name__)

MAILBOX_BUDGET = 256 * 1024 * 1024  # ready blocks waiting for the forward threads before the engine waits
MAILBOX_LIMIT = 1024 * 1024 * 1024  # beyond this (out-of-order use, tied weights), give up
ROLES = ("quantized", "base")


class _Abort(Exception):
    """Stops a forward thread (the reason is recorded separately)."""


@dataclass
class _Slot:
    """One block's tensors, per role, as the engine delivers them."""

    names: dict[str, str]  # state-dict name (prefix + suffix) -> the checkpoint key that provides it
    uses: dict[str, int]  # role -> calls of the block still to serve
    state: dict[str, dict[str, Any]] = field(default_factory=lambda: {r: {} for r in ROLES})
    nbytes: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    delivered: set[str] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        return len(self.delivered) == len(self.names)


def _nbytes(t: Any) -> int:
    if hasattr(t, "__tensor_flatten__") and type(t).__name__ not in ("Tensor", "Parameter"):
        inner, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in inner)
    return int(t.numel() * t.element_size())


class InPassForward:
    """A ``TensorObserver`` for ``stream_quantize``: call ``result()`` after the pass."""

    def __init__(self, library: str, class_name: str, config: dict[str, Any], inputs: dict[str, Any],
                 label: str = "", prepare: Callable[[Any], None] | None = None,
                 gate: threading.RLock | None = None) -> None:
        """``prepare(model)``: applied to each meta-device model before use (the perplexity pass replaces the
        language-model head's forward with one that returns per-token losses: publisher/quality/lm.py). ``gate``:
        held by the quantized forward over each block's forward, shared by the observers of one pass with several
        recipes and by the engine's quantize calls (streaming.engine.Lane), so that one such call or quantized block
        is computed at a time (torchao computes in fp32 on the CPU, quantizing or dequantizing a weight whole: one of
        FLUX.1-dev's 94 MB bf16 weights takes several hundred MB for the call; one such call per recipe at once took
        the process over its 1.2 GiB). None: no gate (one recipe)."""
        self.library, self.class_name, self.config, self.inputs = library, class_name, config, inputs
        self.prepare = prepare
        self.gate, self.gate_held = gate, 0  # gate_held: how deep the quantized thread holds it (nested blocks)
        self.label = label or "model"
        self.cond = threading.Condition()
        self.slots: dict[str, _Slot] = {}
        self.by_key: dict[str, list[str]] = {}  # checkpoint key -> prefixes of the blocks that need it
        self.calls: list[str] = []  # block prefixes in the order the forward calls them
        self.cursor = {r: 0 for r in ROLES}
        self.waiting = {r: False for r in ROLES}
        self.done = {r: False for r in ROLES}
        self.outputs: dict[str, Any] = {}
        self.ready_bytes = 0  # tensors of complete blocks that a forward thread still has to take
        self.held_bytes = 0  # every tensor delivered and not yet taken
        self.loads = 0
        self.peak_block_bytes = 0
        self.reason = ""  # why it gave up ("" while it runs)
        self.fed = False  # the engine has delivered everything
        self.threads: list[threading.Thread] = []
        self.cpu_seconds = {r: 0.0 for r in ROLES}  # each forward thread's own CPU time (waits for tensors excluded)

    # ------------------------------------------------------------ TensorObserver
    def begin(self, readable: list[str]) -> list[str] | None:
        try:
            order = self._plan(set(readable))
        except Exception as exc:  # any failure here only means: check the forward after the pass instead
            self._give_up(f"the forward pass could not be planned ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            return None
        if order is None:
            return None
        for role in ROLES:
            model = self._model()
            self._attach(role, model)
            th = threading.Thread(target=self._run, args=(role, model), name=f"hf-ao-publish-forward-{role}", daemon=True)
            self.threads.append(th)
            th.start()
        return order

    def wants(self, key: str) -> bool:
        return not self.reason and key in self.by_key

    def tensor(self, key: str, value: Any, stored: Any) -> None:
        prefixes = self.by_key.get(key)
        if not prefixes or self.reason:
            return
        with self.cond:
            for prefix in prefixes:
                slot = self.slots[prefix]
                was_ready = slot.ready
                for name, provider in slot.names.items():
                    if provider != key:
                        continue
                    slot.delivered.add(name)
                    for role, t in zip(ROLES, (stored, value)):
                        if slot.uses[role] > 0:
                            slot.state[role][name] = t
                            # A tensor the recipe leaves alone is one object for both roles: its bytes count once
                            # (else a 1 GB embedding, Llama-3's, counted twice, would exceed MAILBOX_LIMIT alone).
                            size = 0 if role == "base" and t is stored and slot.uses["quantized"] > 0 else _nbytes(t)
                            slot.nbytes[role] += size
                            self.held_bytes += size
                if slot.ready and not was_ready:
                    self.ready_bytes += sum(slot.nbytes.values())
            self.cond.notify_all()
            # Backpressure: the forward threads are behind; wait for them rather than hold more tensors.
            while (not self.reason and self.ready_bytes > MAILBOX_BUDGET
                   and any(not self.done[r] and not self.waiting[r] for r in ROLES)):
                self.cond.wait(0.1)
            if not self.reason and self.held_bytes > MAILBOX_LIMIT:
                self._give_up(f"the forward pass would hold more than {MAILBOX_LIMIT >> 20} MiB of weights "
                              "(weights used out of order)")

    def end(self, ok: bool) -> None:
        with self.cond:
            self.fed = True
            if not ok and not self.reason:
                self._give_up("the quantization pass failed")
            self.cond.notify_all()
        for th in self.threads:
            th.join()

    def result(self) -> PassForward:
        if self.reason or any(r not in self.outputs for r in ROLES):
            return PassForward(detail=self.reason or "the forward pass during quantization did not finish")
        return PassForward(self.outputs["quantized"], self.outputs["base"], self.loads, self.peak_block_bytes,
                           f"forward during quantization with {self.loads} block loads", sum(self.cpu_seconds.values()))

    # ------------------------------------------------------------ planning
    def _model(self) -> Any:
        model = meta_model(self.library, self.class_name, self.config)
        if self.prepare is not None:
            self.prepare(model)
        return model

    def _plan(self, readable: set[str]) -> list[str] | None:
        """Trace the block order on the meta device; map each block's tensors to the checkpoint keys that hold them."""

        model = self._model()
        found = blocks(model, 0)
        handles = [module.register_forward_pre_hook(lambda mod, args, p=prefix: self.calls.append(p))
                   for prefix, module, _ in found]
        try:
            forward(model, self.library, to_meta(self.inputs))
        finally:
            for h in handles:
                h.remove()
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        alias_of = {n: names for names in aliases.values() for n in names}
        kinds = {prefix: whole for prefix, _, whole in found}
        modules = {prefix: module for prefix, module, _ in found}
        order: list[str] = []
        for prefix in dict.fromkeys(self.calls):
            names: dict[str, str] = {}
            for _, _, suffix, _ in own_state(modules[prefix], kinds[prefix]):
                name = prefix + suffix
                provider = next((c for c in [name, *alias_of.get(name, [])] if c in readable), None)
                if provider is None:
                    self._give_up(f"{name} is not among the tensors the pass reads")
                    return None
                names[name] = provider
            uses = self.calls.count(prefix)
            self.slots[prefix] = _Slot(names, {r: uses for r in ROLES})
            for provider in names.values():
                self.by_key.setdefault(provider, [])
                if prefix not in self.by_key[provider]:
                    self.by_key[provider].append(prefix)
                order.append(provider)
        return list(dict.fromkeys(order))

    # ------------------------------------------------------------ the forward threads
    def _attach(self, role: str, model: Any) -> None:
        for prefix, module, whole in blocks(model, 0):
            if prefix not in self.slots:
                continue  # never called on these inputs
            saved: list[tuple[Any, str, Any, bool]] = []
            module.register_forward_pre_hook(self._loader(role, prefix, module, whole, saved))
            module.register_forward_hook(self._dropper(role, saved))

    def _loader(self, role: str, prefix: str, module: Any, whole: bool, saved: list) -> Any:
        import torch


        def hook(mod: Any, args: Any) -> None:
            # never wait for tensors holding the gate (a block inside a block): the engine may need it to deliver them
            nested = self._open_gate() if role == "quantized" else 0
            state = self._take(role, prefix)
            items = own_state(module, whole)
            saved[:] = [(owner, attr, (owner._parameters if is_p else owner._buffers)[attr], is_p)
                        for owner, attr, _, is_p in items]
            loaded = {suffix: state[prefix + suffix] for _, _, suffix, _ in items}
            # The engine made these tensors outside inference mode (the forward runs inside it): a tensor subclass
            # cannot be wrapped into a Parameter there ("Cannot set version_counter for inference tensor").
            with torch.inference_mode(False):
                result = module.load_state_dict(loaded, strict=whole, assign=True)
            if not whole and (result.unexpected_keys or any(k in loaded for k in result.missing_keys)):
                raise RuntimeError(f"block {prefix or 'root'}: unexpected {result.unexpected_keys[:3]}")
            if role == "quantized" and self.gate is not None:  # the tensors are in hand: held over the compute only
                for _ in range(nested + 1):
                    self.gate.acquire()
                self.gate_held += nested + 1
            if role == "quantized":
                self.loads += 1
                self.peak_block_bytes = max(self.peak_block_bytes, sum(_nbytes(t) for t in loaded.values()))

        return hook

    def _dropper(self, role: str, saved: list) -> Any:
        def hook(mod: Any, args: Any, output: Any) -> None:
            for owner, attr, original, is_p in saved:
                (owner._parameters if is_p else owner._buffers)[attr] = original  # back to meta: the tensor is freed
            saved.clear()
            if role == "quantized" and self.gate_held:
                self.gate_held -= 1
                self.gate.release()  # type: ignore[union-attr]

        return hook

    def _open_gate(self) -> int:
        """(the quantized thread) Release the gate as often as this thread holds it; how often that was."""
        held, self.gate_held = self.gate_held, 0
        for _ in range(held):
            self.gate.release()  # type: ignore[union-attr]
        return held

    def _take(self, role: str, prefix: str) -> dict[str, Any]:
        """(forward thread) The block's tensors for ``role``, once the engine has delivered them all."""
        with self.cond:
            if self.reason:
                raise _Abort
            at = self.cursor[role]
            if at >= len(self.calls) or self.calls[at] != prefix:
                expected = self.calls[at] if at < len(self.calls) else "nothing"
                self._give_up(f"the forward pass called {prefix or 'the root'} where the meta-device trace had {expected}")
                raise _Abort
            self.cursor[role] += 1
            slot = self.slots[prefix]
            self.waiting[role] = True
            self.cond.notify_all()
            while not slot.ready and not self.reason:
                if self.fed:
                    self._give_up(f"block {prefix} never received all its tensors")
                    break
                self.cond.wait(0.1)
            self.waiting[role] = False
            if self.reason:
                raise _Abort
            state = dict(slot.state[role])
            slot.uses[role] -= 1
            if slot.uses[role] == 0:  # its last call: the slot lets go of these tensors
                self.ready_bytes -= slot.nbytes[role]
                self.held_bytes -= slot.nbytes[role]
                slot.state[role], slot.nbytes[role] = {}, 0
            self.cond.notify_all()
            return state

    def _run(self, role: str, model: Any) -> None:
        started = time.thread_time()
        try:
            self.outputs[role] = forward(model, self.library, self.inputs).detach().clone()
        except _Abort:
            pass
        except Exception as exc:  # recorded: the verification falls back to the forward after the pass
            with self.cond:
                self._give_up(f"the {role} forward pass failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        finally:
            self.cpu_seconds[role] = time.thread_time() - started
            if role == "quantized":  # a block's forward raised: its hook never ran
                self._open_gate()
            with self.cond:
                self.done[role] = True
                self.cond.notify_all()

    def _give_up(self, reason: str) -> None:
        """(holding or not holding the lock: RLock-free, so only set plain fields) Stop both forward passes."""
        if not self.reason:
            self.reason = reason
            log.info("%s: %s; the forward check runs after the pass instead", self.label, reason)
        for slot in self.slots.values():
            slot.state = {r: {} for r in ROLES}
        self.ready_bytes = self.held_bytes = 0


class Together:
    """Several observers of one pass (the FP8 error bound, the verification's forward and the perplexity pass,
    publisher/quality/lm.py) as one ``TensorObserver``, each called in the order given: the engine reads in one order, so an observer that planned another one (or none: it gave
    up) stops at once and says why; the others take every tensor as before."""

    def __init__(self, *observers: TensorObserver | None) -> None:
        self.observers = [o for o in observers if o is not None]

    def begin(self, readable: list[str]) -> list[str] | None:
        order: list[str] | None = None
        for observer in self.observers:
            planned = observer.begin(readable)
            if planned is None:
                continue
            if order is None:
                order = planned
            elif planned != order:
                if isinstance(observer, InPassForward):
                    observer.reason = "its forward pass uses the weights in another order than the pass reads them"
                observer.end(False)  # its threads see the reason and stop
        return order

    def wants(self, key: str) -> bool:
        return any(o.wants(key) for o in self.observers)

    def tensor(self, key: str, value: Any, stored: Any) -> None:
        for observer in self.observers:
            observer.tensor(key, value, stored)

    def end(self, ok: bool) -> None:
        for observer in self.observers:
            observer.end(ok)
