from fd.cli import main

raise SystemExit(main())
