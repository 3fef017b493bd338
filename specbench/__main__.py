from specbench.harness.cli import main

main()
