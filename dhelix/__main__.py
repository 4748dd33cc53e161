"""``python -m dhelix``: the same command line as the ``dhelix`` script."""

from dhelix.cli import main

raise SystemExit(main())
