"""The verifier service: owns the target model and each request; verifies draft chains."""
