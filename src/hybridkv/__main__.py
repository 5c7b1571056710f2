"""``python -m hybridkv`` runs the CLI."""

from __future__ import annotations

from hybridkv.cli.main import main

raise SystemExit(main())
