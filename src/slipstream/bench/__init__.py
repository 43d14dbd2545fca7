"""Load generator and benchmark reports."""
