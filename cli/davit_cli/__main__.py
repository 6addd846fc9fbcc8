import sys

from davit_cli import main

sys.exit(main())
