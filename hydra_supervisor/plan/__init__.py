"""Planning, without side effects: config + model + devices -> a Deployment."""
