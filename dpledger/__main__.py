"""``python -m dpledger`` runs the ``dpledger`` command."""

import sys

from dpledger.cli import main

sys.exit(main())
