"""Tests of buildidd.sessionlog."""
