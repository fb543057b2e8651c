import sys

from dtrain.plan.planner import main

sys.exit(main())
