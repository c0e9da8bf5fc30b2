from nnscaler_jax.cli import main

raise SystemExit(main())
