"""``zero3-offload train``: a byte-level GPT (or, with ``--model``, a local transformers
causal LM: ``hf``) trained with ZeRO-3 and CPU offloading.

``command`` registers the subcommand (``zero3_offload.cli`` imports it from
there); ``options`` and ``sources`` turn flags, ``--config`` and
``--deepspeed-config`` (``deepspeed``) into the effective options; ``launch``
starts the ranks (local or under torchrun); ``loop`` is what each rank runs, on
the ``model`` and ``corpus`` defined here; ``progress`` is what rank 0 prints.
"""

from zero3_offload.train.corpus import ByteCorpus
from zero3_offload.train.model import GPT, GPTShape
from zero3_offload.train.options import TrainOptions

__all__ = ["GPT", "ByteCorpus", "GPTShape", "TrainOptions"]
