"""specbench subpackage."""
