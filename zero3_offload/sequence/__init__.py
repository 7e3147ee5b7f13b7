"""Sequence parallelism (Ulysses) in module mode: each sequence split over a group of ranks.

[Note: sequence parallelism]
With ``sequence_parallel_size = S`` the world's ranks form groups of S consecutive
ranks; the groups are data parallel, and every rank of a group is given the same
batch. :func:`split_sequence` cuts it along the sequence: each rank runs the model's
own forward on its 1/S of the tokens (its input ids and position ids; the labels
shifted first, so the last token of one slice predicts the first of the next).
Everything but attention is per token, so it runs on the slice as is. Attention is
replaced, through transformers' attention-function interface, by
:func:`ulysses_attention`: one all-to-all turns the sequence-sharded queries, keys
and values into head-sharded ones over the whole sequence (each rank holds H/S heads
of all T tokens; with fewer key/value heads than S each is replicated, one per rank, and
:class:`HeadView` gives the implementation that rank's grouping), the model's
configured implementation (eager or sdpa) runs on them
with a mask built for the whole sequence (:func:`full_sequence_mask`: causal, sliding
window, packed rows, padding), and a second all-to-all gives each rank its tokens
back with all heads. The all-to-alls are :class:`AllToAll` autograd functions on a
group of their own (:func:`sequence_group`, its collectives waited for by the library's
rules: :class:`SequenceGroup`), so backward runs the reverse exchanges;
they run on the model thread, on that group only, so they never interleave with the
library's collectives on the world group, which the event loop issues.

At the forward's first attention the ranks of the group compare a fingerprint of the
batch they were given (:meth:`SequenceBatch.check_same_batch`): every rank of a group
must pass the same one.

:func:`sequence_loss` gives every rank of a group the loss of the whole sequence
(the mean over its valid tokens), with the gradient only through the rank's own
tokens. The reduce-scatter averages gradients over all W ranks; the ranks of a group
hold parts of one sequence's gradient, which must add, so the gradient reducer
multiplies by S before it (see ``gradient.reducer``): the mean over the W/S groups
of each group's sum. A token-weighted backward (``tokens=`` the whole sequence's
valid tokens, the same on every rank of the group) counts each group's tokens S
times and its gradient S times: the two cancel.
"""

from zero3_offload.sequence.all_to_all import AllToAll, heads_to_sequence, sequence_to_heads
from zero3_offload.sequence.full_mask import full_sequence_mask
from zero3_offload.sequence.groups import sequence_group
from zero3_offload.sequence.head_view import HeadView
from zero3_offload.sequence.input_split import SEQUENCE_KWARG, split_sequence
from zero3_offload.sequence.loss import sequence_loss
from zero3_offload.sequence.sequence_batch import SequenceBatch
from zero3_offload.sequence.sequence_group import SequenceGroup
from zero3_offload.sequence.sequence_parallel import SequenceParallel
from zero3_offload.sequence.ulysses_attention import ULYSSES, ulysses_attention

__all__ = [
    "SEQUENCE_KWARG",
    "ULYSSES",
    "AllToAll",
    "HeadView",
    "SequenceBatch",
    "SequenceGroup",
    "SequenceParallel",
    "full_sequence_mask",
    "heads_to_sequence",
    "sequence_group",
    "sequence_loss",
    "sequence_to_heads",
    "split_sequence",
    "ulysses_attention",
]
