"""``zero3-offload train``: a byte-level GPT (or, with ``--model``, a local transformers
causal LM: ``hf``) trained with ZeRO-3 and CPU offloading.

``command`` registers the subcommand; ``options`` and ``sources`` turn flags,
``--config`` and ``--deepspeed-config`` (``deepspeed``) into the effective
options; ``launch`` starts the ranks (local or under torchrun); ``loop`` is what
each rank runs, on the ``model`` and ``corpus`` defined here; ``progress`` is
what rank 0 prints.
"""

from zero3_offload.train.command import add_train
from zero3_offload.train.corpus import ByteCorpus
from zero3_offload.train.model import GPT, GPTShape
from zero3_offload.train.options import TrainOptions

__all__ = ["GPT", "ByteCorpus", "GPTShape", "TrainOptions", "add_train"]
