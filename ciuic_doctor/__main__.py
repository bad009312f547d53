"""`python -m ciuic_doctor ...`, the form torchrun's `-m` runs on every rank."""

from ciuic_doctor.cli import console_main

console_main()
