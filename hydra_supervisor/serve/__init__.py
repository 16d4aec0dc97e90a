"""The serving core, one path (docs/architecture.md): a Port per external address, a Lane per
profile on it, a Node for the devices' room shared by every lane of every port."""
