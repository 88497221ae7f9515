import sys

from tensord_server.cli import main

sys.exit(main())
