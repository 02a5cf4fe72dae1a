"""Match a pipeline checkpoint's tensor names to a serial model that names them otherwise.

A family written before :class:`megatron.model.spec_model.SpecModel` builds its pipeline from
layer specs (tensors named by spec index: ``"3.q_proj.weight"``) and its serial model with
attributes of its own (``"layers.2.q_proj.weight"``, ``"final_norm.weight"``); without a key
map, a checkpoint saved at pp > 1 then has none of the serial model's names. When both are
built from the same layers in the same order, the names are not needed: the pipeline's
tensors, in layer-spec order (each stage file's own order within a layer), and the serial
model's, in its state-dict order, pair one to one, and each pair must agree in everything
the checkpoint records about a tensor: its whole shape, how it is split (tensor-parallel
dimension, stride, vocabulary rows), the class of the module holding it and its own name
(``RMSNorm`` / ``weight``). Where the two orders differ, a tensor whose kind is unique on
both sides still pairs; one of several of a kind (the norms of every layer) cannot, and the
match is refused, saying which and what to do (:func:`match_names`).
"""
from typing import Dict, List, Optional, Sequence, Tuple

from ..common.errors import CheckpointError

#: What identifies a tensor without its name: the class of the module holding it (None when
#: the checkpoint does not record it), its own name, its whole shape (the vocabulary rows
#: left out: they are padded per layout) and its record's split dimension, stride and
#: vocabulary flag.
Signature = Tuple[Optional[str], str, Tuple[int, ...], int, int, int]

FIX = ("name the serial model's tensors as its pipeline names them (by layer-spec index: "
       "'0.embed_tokens.weight', ...), or build it with megatron.model.spec_model.SpecModel "
       "from the pipeline's layer specs (docs/new_model.md, section 4); until then, resume "
       "at the saved pipeline size")


def signature(name: str, shape: Sequence[int], record: Sequence[int],
              module_class: Optional[str]) -> Signature:
    """The :data:`Signature` of a tensor.

    Args:
        name: its key (the last part is its own name).
        shape: its whole (merged) shape.
        record: its sharding record ``[tp_dim, stride, vocab_rows, stage, chunk]``.
        module_class: the class name of the module holding it, or None.
    """
    dim, stride, vocab = (int(x) for x in record[:3])
    whole = tuple(int(s) for i, s in enumerate(shape) if not (vocab and i == max(dim, 0)))
    return module_class, name.rsplit(".", 1)[-1], whole, dim, stride, vocab


def pipeline_order(files: Dict[Tuple[int, int], Sequence[str]]) -> List[str]:
    """A pipeline checkpoint's keys in layer-spec order: by spec index (``"3.<...>"``), each
    stage file's order within a spec; a tied module's keys (``tied_modules.<...>``) where
    the first stage holding them has them, before that stage's first spec.

    Args:
        files: ``{(tp_rank, pp_rank): keys in the file's order}``.
    """
    placed: Dict[str, Tuple[float, int, int]] = {}
    for (_, stage), keys in sorted(files.items(), key=lambda item: (item[0][1], item[0][0])):
        heads = [int(k.split(".", 1)[0]) for k in keys if k.split(".", 1)[0].isdigit()]
        first = min(heads) if heads else 0
        for pos, key in enumerate(keys):
            head = key.split(".", 1)[0]
            spot = (float(head), stage, pos) if head.isdigit() else (first - 0.5, stage, pos)
            placed.setdefault(key, spot)
    return sorted(placed, key=placed.get)


def _show(items: List[str]) -> str:
    return ", ".join(items[:4]) + (f" ... ({len(items)} in all)" if len(items) > 4 else "")


def _by_kind(saved: List[str], own: List[str], sig_saved: Dict[str, Signature],
             sig_own: Dict[str, Signature]) -> Tuple[Dict[str, str], List[str]]:
    """Pairs of tensors whose kind (signature) is unique on both sides, and the tensors of
    the kinds that are not."""
    kinds: Dict[Signature, Tuple[List[str], List[str]]] = {}
    for key in saved:
        kinds.setdefault(sig_saved[key], ([], []))[0].append(key)
    for key in own:
        kinds.setdefault(sig_own[key], ([], []))[1].append(key)
    pairs, left = {}, []
    for mine, theirs in kinds.values():
        if len(mine) == len(theirs) == 1:
            pairs[mine[0]] = theirs[0]
        else:
            left += theirs or mine
    return pairs, left


def match_names(saved: List[str], sig_saved: Dict[str, Signature], own: List[str],
                sig_own: Dict[str, Signature], where: str) -> Dict[str, str]:
    """``{saved name: this model's name}`` for every tensor, matched by structure.

    Args:
        saved: the checkpoint's keys in layer-spec order (:func:`pipeline_order`).
        sig_saved: their signatures.
        own: this run's model's keys in its state-dict order.
        sig_own: their signatures.
        where: the checkpoint, for messages.

    Raises:
        CheckpointError: the two do not pair (another count, a tensor of a kind the other
            lacks), or several tensors of a kind come in another order (ambiguous); the
            message names them and the fix.
    """
    if len(saved) == len(own) and all(sig_saved[a] == sig_own[b] for a, b in zip(saved, own)):
        return dict(zip(saved, own))
    pairs, left = _by_kind(saved, own, sig_saved, sig_own)
    if not left and len(pairs) == len(saved) == len(own):
        return pairs
    kinds_saved, kinds_own = sorted(set(sig_saved.values())), sorted(set(sig_own.values()))
    if kinds_saved == kinds_own and len(saved) == len(own):
        raise CheckpointError(
            f"{where} names its tensors as this family's pipeline does and this run's model "
            f"names them otherwise; matched by structure (the same layer classes in the same "
            f"order, shapes checked) the two models hold the same tensors, but "
            f"{len(left)} of them are of kinds several tensors share and come in another "
            f"order ({_show(left)}), so which is which cannot be told; {FIX}")
    only_saved = [k for k in saved if sig_saved[k] not in set(sig_own.values())]
    only_own = [k for k in own if sig_own[k] not in set(sig_saved.values())]
    raise CheckpointError(
        f"{where} names its tensors as this family's pipeline does and this run's model "
        f"names them otherwise, and they cannot be matched by structure: the checkpoint "
        f"holds {len(saved)} tensors, the model {len(own)}; none of the model's is like the "
        f"checkpoint's {_show(only_saved) or '-'}, none of the checkpoint's like the "
        f"model's {_show(only_own) or '-'} (a tensor is told by its module class, its "
        f"name's last part, its whole shape and how it is split); {FIX}")
