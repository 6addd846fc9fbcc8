"""Tests of the development tooling (tools/davit_tools), one folder per subpackage."""
