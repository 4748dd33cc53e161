"""``python -m dhelix``: the same command line as the ``dhelix`` script (a torchrun rank leaves
without the interpreter's clean-up: :func:`dhelix.cli.main.leave`)."""

from dhelix.cli.main import leave, main

leave(main())
