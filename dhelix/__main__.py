"""``python -m dhelix``: the same command line as the ``dhelix`` script."""

from dhelix.dsl.cli import main

raise SystemExit(main())
