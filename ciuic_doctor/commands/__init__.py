"""One module per sub-command (see ciuic_doctor.cli). Standard library imports only at module level."""
