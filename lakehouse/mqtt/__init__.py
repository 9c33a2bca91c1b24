"""MQTT: who may use the embedded Mosquitto (``auth``), its TLS material (``tls``) and Sparkplug B
on the wire (``sparkplug``)."""
