import sys

from hicache.daemon.main import main

sys.exit(main())
