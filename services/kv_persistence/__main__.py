import sys

from services.kv_persistence.service import main

sys.exit(main())
