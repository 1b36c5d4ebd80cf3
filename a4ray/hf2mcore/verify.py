"""Does the written checkpoint reproduce the HF model? Two checks, both through megatron-core's own loader.

* round trip: every mcore tensor is read back (`dist_checkpointing.load`, one layer at a time, so memory
  stays bounded by a layer), turned back into the HF layout and compared with the HF tensor it came from;
  they must be identical (HF cast to the checkpoint's dtype). An HF tensor that several mcore tensors
  share (Qwen3-Next's DeltaNet in_proj and conv1d) is compared once all of them are back in place.
* logits: the checkpoint is loaded into a megatron-core `GPTModel` built from the same config, and its
  logits on a few fixed token sequences are compared with the HF model's, both in fp32. The load must
  also find every key the model asks for, and (a4ray's own output) the checkpoint must hold nothing a
  model of its naming does not ask for. Qwen3-Next too: megatron-core's local layers build it here
  (`a4ray.mcore.hybrid`), its gated delta rule on megatron-core's torch reference; a mapping error the
  round trip cannot see (a swapped in_proj group, a missing norm shift, a gate swapped with its query)
  shows here, and the verdict names the tensors of the first layer whose output departs from the HF model's.

`run` is what the verification Ray task executes; it needs megatron-core (CPU shims in `a4ray.mcore.shims`).
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from a4ray.core.errors import ConvertInputError
from a4ray.hf2mcore.cache import VerifyReport
from a4ray.hf2mcore.hf import HFCheckpoint
from a4ray.hf2mcore.mapping import Slot, extra_states, groups, slots, to_hf, to_mcore
from a4ray.hf2mcore.writer import LEGACY_FILE
from a4ray.mcore import model as mcore_model
from a4ray.mcore import shims
from a4ray.mcore.architecture import Architecture, Naming
from a4ray.mcore.checkpoint_dirs import iteration_dir, read_tracker
from a4ray.mcore.names import TRACKER
from a4ray.spec.conversion import VerifySpec

# What reading a damaged checkpoint raises (DCP's CheckpointException is a BaseException).
_READ_ERRORS = (Exception, CheckpointException)


def checkpoint_dir(root: Path) -> Path:
    """The iteration directory the tracker names (`release`, or `iter_NNNNNNN`)."""
    iteration = read_tracker(root)
    if iteration is None:
        raise ConvertInputError(f"{root}: no readable {TRACKER}; not a Megatron checkpoint")
    return iteration_dir(root, iteration)


def memory_needed(arch: Architecture, spec: VerifySpec) -> int:
    """Bytes the logits check holds: the HF model and the mcore model in fp32, plus activations."""
    if not spec.logits:
        return 0
    params = sum(s.numel for s in slots(arch)) + (arch.vocab * arch.hidden if arch.tied else 0)
    logits = 3 * spec.sequences * spec.seq_len * arch.vocab * 4
    return 2 * params * 4 + logits + 2**30


def run(root: str, input_dir: str, naming: Naming, fmt: str, spec: VerifySpec,
        strict_keys: bool = True) -> VerifyReport:
    """Verify the checkpoint under `root` against the HF checkpoint in `input_dir`. `strict_keys`: any
    tensor the model does not ask for is a problem (a4ray's own output; another tool's checkpoint may also
    hold RNG or optimizer state)."""
    import warnings

    # megatron-core warns at import that TE and apex are missing, which verification knows and wants.
    warnings.filterwarnings("ignore", module=r"(megatron|torch\.distributed\.checkpoint)\.")
    t0 = time.monotonic()
    mcore_model.init_standalone()
    hf = HFCheckpoint.open(input_dir)
    arch = hf.architecture()
    ckpt = checkpoint_dir(Path(root))
    report = VerifyReport(ok=True, tolerance=spec.tolerance, node=socket.gethostname())
    if spec.round_trip:
        (_round_trip_legacy if fmt == "legacy" else _round_trip_dist)(ckpt, hf, arch, naming, report)
    if spec.logits:
        _logits(ckpt, hf, arch, naming, fmt, spec, report, strict_keys)
    report.ok = not report.problems
    report.duration_s = time.monotonic() - t0
    return report


# ---------------------------------------------------------------------------------- round trip


def _compare(group: list[Slot], stored: dict[int, torch.Tensor], hf_reader, arch: Architecture, naming: Naming,
             report: VerifyReport) -> None:
    """Turn a group's mcore tensors (`stored`: slot index -> tensor) back into HF tensors and compare each
    HF tensor whose slots all came back."""
    back: dict[str, torch.Tensor] = {}
    sources: dict[str, list[int]] = {}
    for i, slot in enumerate(group):
        for name, _ in slot.sources:
            sources.setdefault(name, []).append(i)
        if i in stored:
            to_hf(slot, stored[i], arch, into=back)
    for name, feeding in sources.items():
        report.tensors_checked += 1
        if any(i not in stored for i in feeding):
            continue  # a slot that did not load: already a problem
        original = hf_reader.get(name)
        if torch.equal(original.to(back[name].dtype), back[name]):
            report.tensors_equal += 1
            continue
        diff = ((original.float() - back[name].float()).abs().max().item() if original.shape == back[name].shape
                else float("inf"))
        report.round_trip_max_diff = max(report.round_trip_max_diff or 0.0, diff)
        slot = group[feeding[0]]
        if slot.shift and torch.equal(to_mcore(slot, [original], arch, stored[feeding[0]].dtype), stored[feeding[0]]):
            report.tensors_rounded += 1  # the checkpoint holds the mapping's value: w - 1 rounds in this dtype
            continue
        if len(report.problems) < 10:
            theirs = ", ".join(group[i].sharded_key(naming) for i in feeding)
            report.problems.append(f"round trip: {name} differs from the checkpoint's {theirs} (max |diff| {diff:.3g})")


def _round_trip_dist(ckpt: Path, hf: HFCheckpoint, arch: Architecture, naming: Naming, report: VerifyReport) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    reader = hf.reader()
    for name, group in groups(slots(arch)):
        request = {}
        for i, slot in enumerate(group):
            key = slot.sharded_key(naming)
            stored = metadata.get(key)
            if stored is None:
                report.problems.append(f"round trip: {key} is not in the checkpoint")
                continue
            offsets, sizes = slot.chunk(arch)
            stack = slot.stack(arch)[1]
            # The chunk as a tensor of its own rank (leading 1s for layer / expert), not mcore's
            # prepend_axis form, which only loads when every chunk of the tensor is asked for.
            rank_offsets = [(axis, off, n) for axis, (off, n) in enumerate(zip(offsets, stack))]
            data = torch.empty(sizes, dtype=stored.properties.dtype)
            request[str(i)] = ShardedTensor.from_rank_offsets(key, data, *rank_offsets, replica_id=0)
        # One layer at a time: the request covers part of each stacked tensor, which mcore's access
        # check (meant for a whole model's ranks) would refuse.
        try:
            loaded = dist_checkpointing.load(request, str(ckpt), validate_access_integrity=False)
        except _READ_ERRORS as error:  # an unreadable layer is a finding, not a crash
            report.tensors_checked += len({n for s in group for n, _ in s.sources})
            report.problems.append(f"round trip: {name}: cannot be read back: {_last_line(error)}")
            continue
        _compare(group, {int(i): t for i, t in loaded.items() if i.isdigit()}, reader, arch, naming, report)


def _last_line(error: BaseException, limit: int = 300) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {(lines[-1] if lines else '')[:limit]}"


def _round_trip_legacy(ckpt: Path, hf: HFCheckpoint, arch: Architecture, naming: Naming, report: VerifyReport) -> None:
    state = torch.load(ckpt / LEGACY_FILE, map_location="cpu", mmap=True, weights_only=False)["model"]
    reader = hf.reader()
    for _, group in groups(slots(arch)):
        stored = {}
        for i, slot in enumerate(group):
            key = slot.state_key(naming)
            if key in state:
                stored[i] = state[key]
            else:
                report.problems.append(f"round trip: {key} is not in {LEGACY_FILE}")
        _compare(group, stored, reader, arch, naming, report)


# -------------------------------------------------------------------------------------- logits


def _stored_dtype(ckpt: Path, fmt: str) -> torch.dtype:
    key = "embedding.word_embeddings.weight"
    if fmt == "legacy":
        return torch.load(ckpt / LEGACY_FILE, map_location="cpu", mmap=True, weights_only=False)["model"][key].dtype
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata[key].properties.dtype


def _naming(arch: Architecture) -> Naming:
    """The layer spec the verifier builds its model with: megatron-core's local layers (it runs on the CPU,
    where Transformer Engine's do not; Qwen3-Next's on `a4ray.mcore.hybrid`, with TE's names)."""
    return "local"


def _load_into(model, ckpt: Path, arch: Architecture, naming: Naming, fmt: str, report: VerifyReport) -> None:
    """Load the checkpoint into the verifier's model (`_naming`), translating `naming` to its names."""
    ours_naming = _naming(arch)
    pairs = [(s.sharded_key(ours_naming), s.sharded_key(naming), s.state_key(ours_naming), s.state_key(naming))
             for s in slots(arch)]
    if fmt == "legacy":
        state = torch.load(ckpt / LEGACY_FILE, map_location="cpu", weights_only=False)["model"]
        to_local = {theirs: ours for _, _, ours, theirs in pairs}
        wanted = model.state_dict()
        translated = {to_local.get(k, k): v for k, v in state.items()}
        missing = set(wanted) - set(translated)
        if naming != "local":  # TE modules' extra states have other names; TE's loader tolerates them missing
            missing = {k for k in missing if not k.endswith("_extra_state")}
        report.missing_keys = sorted(missing)
        # Extra states of TE modules have no local counterpart; anything else would be a stray tensor.
        report.unexpected_keys = sorted(k for k in set(translated) - set(wanted) if not k.endswith("_extra_state"))
        model.load_state_dict({k: v for k, v in translated.items() if k in wanted}, strict=False)
        return

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.validation import StrictHandling

    rename = {ours: theirs for ours, theirs, _, _ in pairs if ours != theirs}
    request = model.sharded_state_dict()
    for item in nested_values(request):
        item.key = rename.get(item.key, item.key)
    # Under "model", as Megatron-LM asks: load() merges common.pt (args, iteration, ...) into the result.
    loaded, in_ckpt_only, requested_missing = dist_checkpointing.load(
        {"model": request}, str(ckpt), strict=StrictHandling.RETURN_ALL)
    # mcore's words: "missing" = in the checkpoint, not asked for; "unexpected" = asked for, not there.
    other_naming_states = {e.module + "._extra_state" for e in extra_states(arch, naming)}
    report.missing_keys = sorted(requested_missing)
    report.unexpected_keys = sorted(k for k in in_ckpt_only if k not in other_naming_states)
    if not report.missing_keys:
        model.load_state_dict(loaded["model"])


def _logits(ckpt: Path, hf: HFCheckpoint, arch: Architecture, naming: Naming, fmt: str, spec: VerifySpec,
            report: VerifyReport, strict_keys: bool) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load, in every job log otherwise

    if arch.rope_type != "default":
        report.problems.append(f"logits: rope_type {arch.rope_type!r} is not modelled by the verifier; "
                               "set convert.verify.logits=false")
        return
    model = mcore_model.gpt_model(arch, naming=_naming(arch))
    try:
        _load_into(model, ckpt, arch, naming, fmt, report)
    except _READ_ERRORS as error:  # a checkpoint the model cannot load fails the check
        report.problems.append(f"logits: the checkpoint does not load into a megatron-core GPTModel: "
                               f"{_last_line(error)}")
        return
    if report.missing_keys:
        report.problems.append(f"logits: {len(report.missing_keys)} key(s) the model needs are not in the "
                               f"checkpoint: {', '.join(report.missing_keys[:5])}")
        return
    if report.unexpected_keys and strict_keys:
        report.problems.append(f"logits: {len(report.unexpected_keys)} checkpoint key(s) no model of this "
                               f"naming asks for: {', '.join(report.unexpected_keys[:5])}")
    tokens = torch.randint(0, arch.vocab, (spec.sequences, spec.seq_len), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(spec.seq_len).expand(spec.sequences, -1)
    our_taps, their_taps = _Taps(), _Taps()
    with torch.no_grad():
        our_taps.tap_mcore(model)
        ours = model(input_ids=tokens, position_ids=positions, attention_mask=shims.causal_mask(spec.seq_len))
        del model
        # The reference holds the weights rounded as the checkpoint stores them, then computes in fp32 too.
        reference = AutoModelForCausalLM.from_pretrained(hf.path, dtype=_stored_dtype(ckpt, fmt),
                                                         attn_implementation="eager").float().eval()
        their_taps.tap_hf(reference)
        theirs = reference(input_ids=tokens).logits
    diff = (ours.float() - theirs.float()).abs().max().item()
    peak = theirs.abs().max().item()
    report.logits_checked = True
    report.max_abs_diff = diff
    report.max_rel_diff = diff / peak if peak else diff
    report.logits_scale = peak
    report.top1_agreement = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    if not diff <= spec.tolerance * max(1.0, peak):
        report.problems.append(f"logits: max |diff| {diff:.3g} is above the tolerance {spec.tolerance:g} "
                               f"x scale {max(1.0, peak):.3g}" + _first_departure(our_taps, their_taps, arch, spec))


class _Taps:
    """What each layer's mixer (attention / gated DeltaNet) and MLP put out in one forward pass, as
    [batch, seq, hidden] in fp32, keyed (layer, 0 mixer | 1 MLP) in model order; (-1, 0): the embedding."""

    def __init__(self):
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def _tap(self, module, key: tuple[int, int], seq_first: bool) -> None:
        def keep(_module, _inputs, output):
            output = output[0] if isinstance(output, tuple) else output
            # a copy: megatron-core adds the residual into the output in place afterwards
            self.outputs[key] = (output.transpose(0, 1) if seq_first else output).detach().float().clone()

        module.register_forward_hook(keep)

    def tap_mcore(self, model) -> None:  # megatron-core computes [seq, batch, hidden]
        self._tap(model.embedding, (-1, 0), True)
        for i, layer in enumerate(model.decoder.layers):
            self._tap(layer.self_attention, (i, 0), True)
            self._tap(layer.mlp, (i, 1), True)

    def tap_hf(self, model) -> None:
        self._tap(model.model.embed_tokens, (-1, 0), False)
        for i, layer in enumerate(model.model.layers):
            self._tap(getattr(layer, "linear_attn", None) or layer.self_attn, (i, 0), False)
            self._tap(layer.mlp, (i, 1), False)


def _first_departure(ours: _Taps, theirs: _Taps, arch: Architecture, spec: VerifySpec) -> str:
    """`; ` + which HF tensors feed the first module whose output departs from the HF model's (every later
    one sees a different input), or "" if none does (then the final norm or the output head)."""
    for key in sorted(theirs.outputs):
        a, b = ours.outputs.get(key), theirs.outputs[key]
        if a is None or a.shape != b.shape:
            continue
        diff, scale = (a - b).abs().max().item(), b.abs().max().item()
        if diff <= spec.tolerance * max(1.0, scale):
            continue
        layer, part = key
        if layer < 0:
            where, feeding = "the embedding", ["model.embed_tokens.weight"]
        else:
            module = "mlp" if part else ("self_attn" if arch.full_attention(layer) else "linear_attn")
            norm = "post_attention_layernorm" if part else "input_layernorm"
            prefixes = (f"model.layers.{layer}.{module}.", f"model.layers.{layer}.{norm}.")
            feeding = sorted({re.sub(r"\.experts\.\d+\.", ".experts.*.", name) for slot in slots(arch)
                              if slot.layer == layer for name, _ in slot.sources if name.startswith(prefixes)})
            where = f"layer {layer}'s {module}"
        return (f"; {where} is the first to depart from the HF model's (max |diff| {diff:.3g} at scale "
                f"{scale:.3g}): one of {', '.join(feeding)} is mapped wrongly")
    return "; no layer departs: the final norm (model.norm.weight) or the output head (lm_head.weight)"
