"""The deployable artefacts under deploy/ (make test-deploy; marker ``deploy``)."""
