"""Measurement code that runs in or beside a training job; installed as `ciuic_doctor.probes`."""
