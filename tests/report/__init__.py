"""Tests of the privacy report (``dpledger report``)."""
