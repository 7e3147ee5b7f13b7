"""``python -m zero3_offload``: the ``zero3-offload`` command."""

from zero3_offload.cli import main

raise SystemExit(main())
