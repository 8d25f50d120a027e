"""``python -m benchmarks list | run NAME [ARGS] | smoke [...]``: see :mod:`benchmarks.runner`."""

from benchmarks.runner import main

raise SystemExit(main())
