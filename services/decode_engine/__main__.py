import sys

from services.decode_engine.service import main

sys.exit(main())
