"""Supervised fine-tuning data: examples read from files, rendered to tokens, batched.

One module per role:

- ``source``: what ``--data`` names (text, record files, a ``datasets`` directory);
- ``text_check``: refusing binary files given as text;
- ``readers``: the raw records of JSONL, JSON, Parquet, CSV files and ``datasets``
  directories, each with its file and line or row;
- ``example``: one example (``text``, ``prompt``/``completion`` or ``messages``);
- ``record_format``: the shape of the records and how a record becomes an example;
- ``example_loader``: every example of a source, with the bad-record policy;
- ``chat_render``: an example as token ids and a loss mask (the chat template, with
  assistant masks);
- ``token_dataset``: the rendered examples with the ``--max-seq-len`` rule;
- ``order``: the example order of (seed, epoch, global position) and how a step's
  global batch is dealt to ranks and micro-steps;
- ``batch`` and ``collate``: a micro-batch, padded to its longest example or packed;
- ``sft_data``: the whole pipeline as the training loop uses it.

Nothing here imports ``transformers`` or ``datasets`` at module import.
"""
