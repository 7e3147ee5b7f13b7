"""ZeRO-3 with offload under the training frameworks users already have: transformers'
``Trainer`` and TRL (``Zero3Trainer``, ``Zero3TrainerMixin``), Lightning
(``Zero3Strategy``), on the manager's synchronous face (``zero3_offload.sync``).

Public through ``zero3_offload.integrations`` (docs/integrations.md). Each framework is
imported only by the module of its class: importing this package imports none of them.
"""
