import sys

from longserve.server.cli import main

sys.exit(main())
