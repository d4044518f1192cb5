"""``python -m kunlun_infer``: the same as the ``kunlun-infer`` command."""

from kunlun_infer.cli import main

raise SystemExit(main())
