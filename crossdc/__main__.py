import sys

from crossdc.cli import main

sys.exit(main())
