from specbench.cli.app import main

main()
